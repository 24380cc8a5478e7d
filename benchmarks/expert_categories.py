"""The categories of an MoE training step's time, and the table of rules that puts each unit of time into one.

A unit is a kernel or an op's self time (``Unit``), with the op that launched it, that op's ancestors and the
input shapes of the outermost product among them. The rules read names (ops, kernels, autograd Functions) and
shapes against the shape's widths (``Dims``): an operand of rank width makes a LoRA term; an expert bank's shape
(E × 2I × H, E × H × I, or one expert's slice), a width I or 2I, or the routed-row count S = tokens × top-k
marks expert work. Widths that coincide make the rules ambiguous, so the shapes they run on keep them apart
(see tiny-moe in bench_rows.py). profile_experts.py gathers the units from a profile.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from bench_rows import RANK, SHAPES

# Ops whose products the GEMM rules read (the outermost one in a unit's ancestry decides: a grouped GEMM over
# its per-expert mm calls, a linear over its mm).
GEMM_OPS = re.compile(r"aten::(mm|addmm_?|bmm|baddbmm|matmul|linear|einsum|_grouped_mm|_scaled_grouped_mm)$")
GROUPED = re.compile(r"grouped_mm|grouped_gemm", re.IGNORECASE)  # aten's and libraries' custom grouped ops
GEMM_KERNEL = re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|grouped_mm", re.IGNORECASE)
OPTIMIZER = re.compile(r"Optimizer\.|multi_tensor|fused_adam|_foreach_", re.IGNORECASE)
ATTENTION = re.compile(r"attention|flash|fmha|sdpa|scaled_dot_product", re.IGNORECASE)
EMBED_LOSS = re.compile(r"embedding|cross_?entropy|nll_loss|log_softmax", re.IGNORECASE)
ROUTING = re.compile(
    r"sort|radix|histc|histogram|cumsum|scan|topk|bincount|one_hot|nonzero|scatter|gather|index|unique|combine"
    r"|permute",
    re.IGNORECASE,
)
EXPERT_SCOPE = re.compile(r"expert|moe", re.IGNORECASE)
LORA_SCOPE = re.compile(r"lora", re.IGNORECASE)
ACTIVATION_NAME = re.compile(
    r"silu|gelu|swiglu|geglu|gated_act|act_and_mul|_act_(for|back)ward", re.IGNORECASE
)
ELEMENTWISE = re.compile(
    r"aten::(mul|add|sub|rsub|div|sigmoid|silu|gelu|tanh|exp|neg|copy|clone|contiguous|to|_to_copy|fill|zero|cat"
    r"|sum|masked_fill|where|split|chunk|slice)"
)


@dataclass(frozen=True)
class Dims:
    """The widths that identify a shape's products: rank r, experts E, hidden H, expert width I, tokens T, experts
    per token K (routed rows S = T × K), attention widths q and kv, vocabulary V."""

    rank: int
    experts: int
    hidden: int
    inter: int
    tokens: int
    top_k: int
    q: int
    kv: int
    vocab: int

    @property
    def routed(self) -> int:
        return self.tokens * self.top_k

    @classmethod
    def of(cls, shape: str) -> Dims:
        _, cfg, batch, seq = SHAPES[shape]
        widths = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        head = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        attention = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
        return cls(RANK, *widths, batch * seq, cfg["num_experts_per_tok"], *attention, cfg["vocab_size"])

    def bank(self, dims: tuple[int, ...]) -> bool:
        """An expert bank (E × 2I × H, E × H × I, either order of the last two) or one expert's slice of it."""
        widths = sorted(dims[-2:])
        slices = (sorted((2 * self.inter, self.hidden)), sorted((self.hidden, self.inter)))
        return widths in slices and (len(dims) == 2 or (len(dims) == 3 and dims[0] == self.experts))

    def weight(self, dims: tuple[int, ...]) -> bool:
        """A frozen base weight: an attention projection's (either orientation) or an expert bank or slice."""
        widths = sorted(dims[-2:])
        dense = len(dims) == 2 and widths in (sorted((self.hidden, self.q)), sorted((self.hidden, self.kv)))
        return dense or self.bank(dims)

    def expert_work(self, dims: tuple[int, ...]) -> bool:
        """A tensor of the experts: a bank (or slice), per-expert 3-D, the I / 2I widths, or S routed rows."""
        return (
            self.bank(dims)
            or (len(dims) == 3 and dims[0] == self.experts)
            or any(d in (self.inter, 2 * self.inter, self.routed) for d in dims)
        )


@dataclass(frozen=True)
class Unit:
    """One unit of time: a kernel (CUDA) or an op's self time (CPU), with what the event tree says about it."""

    name: str  # the kernel's name, or the op's
    us: float
    op: str = ""  # the op that launched it ("" when no op claims the kernel)
    # that op's tensor inputs (2-D and up; offsets and scalars left out)
    shapes: tuple[tuple[int, ...], ...] = ()
    gemm: str = ""  # the outermost GEMM op among the op and its ancestors
    gemm_shapes: tuple[tuple[int, ...], ...] = ()
    ancestors: tuple[str, ...] = ()  # the op and its enclosing ops, innermost first

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.ancestors)

    def matches(self, pattern: re.Pattern) -> bool:
        return any(pattern.search(n) for n in self.names())


def _is_gemm(u: Unit) -> bool:
    return bool(u.gemm) or (not u.op and bool(GEMM_KERNEL.search(u.name)))


def _product(u: Unit) -> tuple[tuple[int, ...], int] | None:
    """The product's result shape and reduced dimension, from its two matrix operands (``None`` when the op
    does not say); a grouped product that reduces over each expert's rows gives one matrix per expert (E = -1)."""
    ops = list(u.gemm_shapes)
    if u.gemm.startswith(("aten::addmm", "aten::baddbmm")) and len(ops) == 3:
        ops = ops[1:]  # the added input first
    if len(ops) < 2 or u.gemm == "aten::einsum":
        return None
    a, b = ops[0], ops[1]
    if u.gemm == "aten::linear":  # x (..., in) and W (out, in)
        return (*a[:-1], b[0]), a[-1]
    if GROUPED.search(u.gemm) and len(a) == 2 and len(b) == 2 and a[-1] == b[0]:
        return (-1, a[0], b[1]), a[-1]
    return (*a[:-1], b[-1]), a[-1]


def _lora(u: Unit, d: Dims) -> bool:
    """A LoRA product: one with an operand of rank width, unless another operand is a base weight's 2-D matrix
    (an expert loop's product for an expert that received exactly r rows); or, inside a LoRA op (by name: loralei's
    and Unsloth's autograd Functions), one with stacked factors (a width of 2r to 8r, as q/k/v factors side by
    side) and no base weight at all."""
    if not _is_gemm(u):
        return False
    shapes = u.gemm_shapes
    weight_2d = any(len(s) == 2 and d.weight(s) for s in shapes)
    if any(d.rank in s for s in shapes):
        return not weight_2d
    stacked = any(0 < n <= 8 * d.rank and n % d.rank == 0 for s in shapes for n in s)
    return u.matches(LORA_SCOPE) and stacked and not any(d.weight(s) for s in shapes)


def _expert_gemm(u: Unit, d: Dims) -> bool:
    """A product of the experts: a grouped GEMM, one inside an experts op (by name: loralei's, Unsloth's and
    others' autograd Functions and custom ops), or one with an expert tensor (``Dims.expert_work``)."""
    marked = bool(GROUPED.search(u.gemm)) or u.matches(EXPERT_SCOPE)
    return _is_gemm(u) and (marked or any(d.expert_work(s) for s in u.gemm_shapes))


def _bank_gradient(u: Unit, d: Dims) -> bool:
    """A product whose result is an expert bank (or one expert's slice) reduced over rows (not over a width): the
    gradient of a bank that requires grad, as a merged W + BA bank does."""
    product = _product(u) if _is_gemm(u) else None
    if product is None:
        return False
    out, reduced = product
    rows = reduced not in (d.hidden, d.inter, 2 * d.inter, d.rank)
    return rows and (d.bank(out) or (len(out) == 3 and out[0] == -1))


def _router_gemm(u: Unit, d: Dims) -> bool:
    return _is_gemm(u) and any(sorted(s) == sorted((d.experts, d.hidden)) for s in u.gemm_shapes)


def _activation(u: Unit, d: Dims) -> bool:
    """The experts' gated activation: by name (aten's, Liger's, Triton's, loralei's kernels), or an elementwise
    op on routed rows of width I or 2I."""
    if ACTIVATION_NAME.search(u.name) or (u.op and ACTIVATION_NAME.search(u.op)):
        return True
    rows = [s for s in u.shapes if len(s) == 2 and s[-1] in (d.inter, 2 * d.inter)]
    return bool(ELEMENTWISE.match(u.op)) and bool(rows) and not any(len(s) == 3 for s in u.shapes)


def _routing(u: Unit, d: Dims) -> bool:
    """Router GEMM and softmax, sort / histogram / cumsum / top-k, gathers and scatters of rows, and the
    per-token combine (elementwise work on S routed rows or T × K tensors)."""
    if _router_gemm(u, d) or ROUTING.search(u.op) or ROUTING.search(u.name):  # the name: compiled kernels
        return True
    if "softmax" in u.op and any(s[-1] == d.experts for s in u.shapes):
        return True
    combine = any(s[0] == d.routed or s[:2] == (d.tokens, d.top_k) for s in u.shapes)
    return bool(ELEMENTWISE.match(u.op)) and combine


def _bank_elementwise(u: Unit, d: Dims) -> bool:
    """Elementwise work on whole expert banks (E × ...): e.g. PEFT's W + BA, or copies of a bank."""
    return any(len(s) == 3 and s[0] == d.experts and d.bank(s) for s in u.shapes)


# (category, predicate): the first category whose predicate holds takes the unit.
CATEGORIES: list[tuple[str, Callable[[Unit, Dims], bool]]] = [
    ("optimizer", lambda u, d: u.matches(OPTIMIZER)),
    ("attention", lambda u, d: u.matches(ATTENTION)),
    # the output head's products by their vocabulary width (a fused loss may chunk them into rows that look
    # like other products' widths, e.g. Liger's 128-row chunks against a 128-expert router's)
    ("embedding / loss", lambda u, d: u.matches(EMBED_LOSS) or any(d.vocab in s for s in u.gemm_shapes)),
    ("LoRA GEMM (experts)", lambda u, d: _lora(u, d) and _expert_gemm(u, d)),
    ("LoRA GEMM (attention)", _lora),
    ("expert GEMM (bank gradient)", _bank_gradient),
    ("expert GEMM (base)", lambda u, d: _expert_gemm(u, d) and not _router_gemm(u, d)),
    ("expert activation", _activation),
    ("routing / permute / combine", _routing),
    ("dense GEMM (q/k/v/o)", lambda u, d: _is_gemm(u)),
    ("expert bank elementwise", _bank_elementwise),
    ("other", lambda u, d: True),
]


def classify(unit: Unit, dims: Dims) -> str:
    return next(label for label, test in CATEGORIES if test(unit, dims))
