"""Gated activations ``h = act(gate) * up`` (SwiGLU, GeGLU erf, GeGLU tanh): one Triton kernel plus launchers.

Forward and backward share one kernel so the activation formulas are written once; the backward recomputes
``act(gate)`` and its slope from ``gate`` instead of reading a stored copy. Math in fp32, stores in the input
dtype. Derivatives (``σ`` = sigmoid, ``Φ``/``φ`` = normal CDF/PDF, ``k = √(2/π)``, ``c = 0.044715``)::

    silu:      a = g σ(g)                 a' = σ(g) (1 + g (1 - σ(g)))
    gelu:      a = g Φ(g)                 a' = Φ(g) + g φ(g)
    gelu_tanh: a = g σ(2u), u = k (g + c g³)   a' = σ(2u) + 2 g σ(2u) (1 - σ(2u)) k (1 + 3 c g²)

``gelu_tanh`` uses ``0.5 (1 + tanh(u)) = σ(2u)``, which avoids the cancellation of ``1 + tanh(u)`` for
negative ``g``. Backward: ``d_up = dh · a``, ``d_gate = dh · up · a'``.

Where Triton cannot run (no triton, or a CPU tensor without ``TRITON_INTERPRET=1``), the same formulas run in
plain torch. The kernel objects are built lazily per mode (compiled or interpreted), so ``TRITON_INTERPRET``
is read at call time, not at import time.
"""

import functools
import math
import types
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ImportError:  # the torch formulas below then serve every call
    triton = None
    # Only so the kernel's ``tl.constexpr`` annotations evaluate; the kernel is never launched without triton.
    tl = types.SimpleNamespace(constexpr=int)

ACTIVATIONS: dict[str, int] = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# fp64 (tests, references) always takes the torch path, computed in fp64.
_SUPPORTED_DTYPES = (*_KERNEL_DTYPES, torch.float64)
# The Triton interpreter computes bf16 through numpy, which has no bf16: it returns NaN.
_INTERPRETER_DTYPES = (torch.float32, torch.float16)
_BLOCK = 1024
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


_INTERPRETER_HELPERS: dict[str, Callable] = {}  # helper name -> its plain function (see build_kernel)


def jit_helper(fn: Callable) -> Callable:
    """``fn`` as a Triton device function that kernels call by its name; the interpreter gets the plain function.

    Helpers use builtins only (``tl.load``, ``tl.exp``...), so that the interpreter can run them as Python.
    """
    _INTERPRETER_HELPERS[fn.__name__] = fn
    return JITFunction(fn) if triton is not None else fn


def _add_fn(a, b):
    return a + b


# The combine function of sums through ``tl.reduce(x, axis, add_combine)``. ``tl.sum`` is a jitted helper that the
# interpreter cannot call when TRITON_INTERPRET was set after triton's import; ``tl.reduce`` takes a JIT function
# and the interpreter runs its Python body (``.fn``).
add_combine = triton.jit(_add_fn) if triton is not None else _add_fn


@jit_helper
def act_and_slope(g, ACT: tl.constexpr):
    """``(act(g), act'(g))`` in fp32 for the activation code ``ACT`` (the module docstring's formulas)."""
    if ACT == 0:
        sig = 1.0 / (1.0 + tl.exp(-g))
        act = g * sig
        slope = sig * (1.0 + g * (1.0 - sig))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        act = g * cdf
        slope = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        sig = 1.0 / (1.0 + tl.exp(-2.0 * inner))
        act = g * sig
        slope = sig + 2.0 * g * sig * (1.0 - sig) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    return act, slope


def _gated_act_kernel(
    gate_ptr,
    up_ptr,
    dh_ptr,
    h_ptr,
    dgate_ptr,
    dup_ptr,
    n_elements,
    ACT: tl.constexpr,
    BACKWARD: tl.constexpr,
    STORE_H: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n_elements
    g = tl.load(gate_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    act, slope = act_and_slope(g, ACT)
    # Loads all happen before stores at the same offsets, so the outputs may alias the inputs.
    if BACKWARD:
        dh = tl.load(dh_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    if STORE_H:
        tl.store(h_ptr + offs, (act * u).to(h_ptr.dtype.element_ty), mask=valid)
    if BACKWARD:
        tl.store(dgate_ptr + offs, (dh * u * slope).to(dgate_ptr.dtype.element_ty), mask=valid)
        tl.store(dup_ptr + offs, (dh * act).to(dup_ptr.dtype.element_ty), mask=valid)


@torch.compiler.assume_constant_result  # Dynamo cannot trace triton's env read; a compiled graph fixes it
def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` is set now (read at launch time, not import time)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def triton_usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernel can run on ``t``.

    Args:
        t: a tensor the kernel would read.

    Returns:
        True for an fp32/fp16/bf16 CUDA tensor when triton is importable, or for an fp32/fp16 tensor when
        ``TRITON_INTERPRET=1`` is set (the interpreter yields NaN for bf16, so bf16 then takes the torch path).
    """
    if triton is None or t.dtype not in _KERNEL_DTYPES:
        return False
    if interpret_requested():
        return t.dtype in _INTERPRETER_DTYPES
    return t.is_cuda


def _with_globals(fn: Callable, **names: object) -> Callable:
    """A copy of ``fn`` that sees ``names`` in place of its module's globals of those names."""
    return types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__)


def _plain_helpers() -> dict[str, Callable]:
    """Every :func:`jit_helper` as its plain function, each seeing the others' plain functions (helpers call
    helpers)."""
    plain = {name: _with_globals(fn) for name, fn in _INTERPRETER_HELPERS.items()}
    for fn in plain.values():
        fn.__globals__.update(plain)
    return plain


def build_kernel(fn: Callable, interpret: bool, wrap: Callable[[Callable], Callable] | None = None):
    """``fn`` as a compiled Triton kernel (optionally wrapped, e.g. by ``triton.autotune``) or for the interpreter.

    ``TRITON_INTERPRET`` may be set after triton was imported, when ``triton.language``'s own jitted helpers
    (``tl.cdiv``, ``tl.zeros``, ``tl.sigmoid``...) are compiled-mode objects that the interpreter cannot call. So
    kernels use builtins only, and in the interpreter every :func:`jit_helper` runs as the plain Python function.
    """
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_with_globals(fn, **_plain_helpers()))
    kernel = triton.jit(fn)
    return wrap(kernel) if wrap is not None else kernel


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: fp32 products in full fp32 ("ieee", not TF32);
    narrower dtypes ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_autotuned(kernel, tuned: dict[tuple, dict], key: tuple, grid, *args, **kwargs) -> dict:
    """Launches a ``triton.autotune``-wrapped ``kernel``: the first launch per ``key`` goes through the autotuner,
    later ones call the kernel with the config it chose (remembered in ``tuned``), skipping the autotuner's
    per-call Python work (it shows on small models, where the CPU issues kernels barely ahead of the GPU).

    Under torch's deterministic algorithms (``training.deterministic``) the kernel runs at its first config
    instead: the autotuner picks by timing, so two processes could tile, and round, the same sums differently.

    Returns:
        The config for ``key``, as launch keyword arguments.
    """
    deterministic = torch.are_deterministic_algorithms_enabled()
    config = tuned.get((key, deterministic))
    if config is None and deterministic:
        config = tuned[(key, True)] = kernel.configs[0].all_kwargs()
    if config is None:
        kernel[grid](*args, **kwargs)
        config = tuned[(key, False)] = kernel.best_config.all_kwargs()
    else:
        kernel.fn[grid](*args, **kwargs, **config)
    return config


@functools.cache
def _kernel(interpret: bool):
    """The elementwise kernel compiled for the GPU or wrapped for the interpreter, built once per mode."""
    return build_kernel(_gated_act_kernel, interpret)


def activation_code(activation: str) -> int:
    """Maps an activation name to the kernel's constant.

    Args:
        activation: one of ``ACTIVATIONS``.

    Returns:
        The integer the kernel branches on.

    Raises:
        ValueError: for an unknown name; the message lists the supported ones.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is not supported by the fused gated MLP; "
            f"use one of {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[activation]


def _check(tensors: dict[str, torch.Tensor]) -> None:
    first_name, first = next(iter(tensors.items()))
    if first.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{first_name}.dtype={first.dtype} is not supported; use fp32, fp16, bf16 or fp64")
    for name, t in tensors.items():
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device} but {first_name} has "
                f"{tuple(first.shape)}, {first.dtype}, {first.device}; pass tensors that match"
            )


def torch_act_and_slope(g: torch.Tensor, code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's formulas in torch on an fp32 or fp64 ``g``: returns ``(act(g), act'(g))``."""
    if code == 0:
        sig = torch.sigmoid(g)
        return g * sig, sig * (1.0 + g * (1.0 - sig))
    if code == 1:
        cdf = 0.5 * (1.0 + torch.special.erf(g * math.sqrt(0.5)))
        return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2.0 * math.pi)
    sig = torch.sigmoid(2.0 * _SQRT_2_OVER_PI * (g + _GELU_TANH_C * g * g * g))
    slope = sig + 2.0 * g * sig * (1.0 - sig) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * g * g)
    return g * sig, slope


def _launch(gate: torch.Tensor, up: torch.Tensor, code: int, dh: torch.Tensor | None, outs: tuple) -> None:
    """Runs the kernel over all elements; ``outs`` = (h or None, d_gate or None, d_up or None)."""
    h, d_gate, d_up = outs
    n = gate.numel()
    if n == 0:
        return
    backward = dh is not None
    # Unused pointer slots get a real tensor so every launch has the same signature.
    _kernel(interpret_requested())[(triton.cdiv(n, _BLOCK),)](
        gate,
        up,
        dh if backward else gate,
        h if h is not None else gate,
        d_gate if backward else gate,
        d_up if backward else gate,
        n,
        ACT=code,
        BACKWARD=backward,
        STORE_H=h is not None,
        BLOCK=_BLOCK,
    )


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """fp32 for the low-precision dtypes (as in the kernel), fp64 stays fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _forward_impl(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    code = ACTIVATIONS[activation]
    if not triton_usable(gate):
        act, _ = torch_act_and_slope(_upcast(gate), code)
        return (act * _upcast(up)).to(gate.dtype)
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    _launch(gate, up, code, None, (h, None, None))
    return h


def _backward_impl(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, inplace: bool, want_h: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    code = ACTIVATIONS[activation]
    if not triton_usable(gate):
        act, slope = torch_act_and_slope(_upcast(gate), code)
        up32, dh32 = _upcast(up), _upcast(dh)
        results = (act * up32 if want_h else None, dh32 * up32 * slope, dh32 * act)
        if not inplace:
            return tuple(None if r is None else r.to(gate.dtype) for r in results)
        dsts = (dh if want_h else None, gate, up)
        return tuple(None if r is None else dst.copy_(r) for dst, r in zip(dsts, results, strict=True))
    if inplace:
        outs = (dh if want_h else None, gate, up)
    else:
        dh, gate, up = dh.contiguous(), gate.contiguous(), up.contiguous()
        outs = tuple(torch.empty_like(gate) if keep else None for keep in (want_h, True, True))
    _launch(gate, up, code, dh, outs)
    if inplace:  # the kernel wrote through raw pointers; let autograd see that these tensors changed
        torch.autograd.graph.increment_version([t for t in outs if t is not None])
    return outs


# Custom ops hide the launch (Triton or torch, chosen at run time) from torch.compile, so Dynamo does not
# trace into the launcher and break the graph. Eager calls that need no autograd skip them (see eager_call).
def eager_call(*tensors: torch.Tensor) -> bool:
    """Whether to call a kernel's implementation directly instead of its custom op.

    torch.library's dispatch costs CPU time on every call, which shows where the CPU issues kernels barely ahead
    of the GPU (small models); it is needed only under torch.compile, or where autograd must record the op.

    Args:
        tensors: the op's differentiable inputs (none for ops without autograd).
    """
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


@torch.library.custom_op("loralei::gated_act_fwd", mutates_args=())
def _fwd_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return _forward_impl(gate, up, activation)


@torch.library.custom_op("loralei::gated_act_bwd", mutates_args=())
def _bwd_op(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, want_h: bool
) -> list[torch.Tensor]:
    return [t for t in _backward_impl(dh, gate, up, activation, False, want_h) if t is not None]


@torch.library.custom_op("loralei::gated_act_bwd_", mutates_args=("dh", "gate", "up"))
def _bwd_inplace_op(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, want_h: bool
) -> None:
    _backward_impl(dh, gate, up, activation, True, want_h)


@_fwd_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return gate.new_empty(gate.shape)


@_bwd_op.register_fake
def _(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, want_h: bool) -> list:
    return [gate.new_empty(gate.shape) for _ in range(2 + want_h)]


@_bwd_inplace_op.register_fake
def _(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, want_h: bool) -> None:
    return None


def _fwd_setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    gate, up, ctx.activation = inputs
    ctx.save_for_backward(gate, up)


def _fwd_backward(ctx, dh: torch.Tensor) -> tuple:
    gate, up = ctx.saved_tensors
    d_gate, d_up = _bwd_op(dh, gate, up, ctx.activation, False)
    return d_gate, d_up, None


# Makes gated_act_forward differentiable on its own (the fused MLP op calls the backward directly).
_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def gated_act_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``h = act(gate) * up``, elementwise; differentiable (its backward is :func:`gated_act_backward`).

    Args:
        gate: gate projection output, any shape, fp32/fp16/bf16 (fp64 runs the torch formulas).
        up: up projection output, same shape, dtype and device.
        activation: "silu", "gelu" or "gelu_tanh".

    Returns:
        ``h`` with the inputs' shape and dtype (contiguous).

    Raises:
        ValueError: unknown activation, unsupported dtype or mismatched inputs.
    """
    activation_code(activation)
    _check({"gate": gate, "up": up})
    if eager_call(gate, up):
        return _forward_impl(gate, up, activation)
    return _fwd_op(gate, up, activation)


def _backward(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, inplace: bool, want_h: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Validates, then runs the functional or the in-place backward op."""
    activation_code(activation)
    tensors = {"dh": dh, "gate": gate, "up": up}
    _check(tensors)
    if not inplace:
        if eager_call():
            return _backward_impl(dh, gate, up, activation, False, want_h)
        outs = _bwd_op(dh, gate, up, activation, want_h)
        return (outs[0] if want_h else None, outs[-2], outs[-1])
    if not all(t.is_contiguous() for t in tensors.values()):
        raise ValueError(
            "inplace=True needs contiguous dh, gate and up; call .contiguous() or pass inplace=False"
        )
    if eager_call():
        return _backward_impl(dh, gate, up, activation, True, want_h)
    _bwd_inplace_op(dh, gate, up, activation, want_h)
    return (dh if want_h else None, gate, up)


def gated_act_backward_with_h(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`gated_act_forward` that also recomputes ``h`` (the down projection's input).

    One pass reads ``dh``, ``gate``, ``up`` and writes ``h``, ``d_gate``, ``d_up``; the fused MLP needs ``h``
    again in its backward (for the down projection's ``dA``) and recomputing it here is free of extra reads.

    Args:
        dh: gradient of the loss w.r.t. ``h``.
        gate: the forward's gate input (pre-activation); ``act(gate)`` is recomputed from it.
        up: the forward's up input.
        activation: "silu", "gelu" or "gelu_tanh".
        inplace: write ``h`` into ``dh``, ``d_gate`` into ``gate`` and ``d_up`` into ``up`` instead of
            allocating three new buffers; the inputs are destroyed and must be contiguous.

    Returns:
        ``(h, d_gate, d_up)``, each with the inputs' shape and dtype.

    Raises:
        ValueError: unknown activation, unsupported dtype, mismatched inputs, or ``inplace`` with a
            non-contiguous input.
    """
    return _backward(dh, gate, up, activation, inplace, want_h=True)


def gated_act_backward(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``h = act(gate) * up``: ``(d_gate, d_up)`` from ``(dh, gate, up)``.

    Args:
        dh: gradient of the loss w.r.t. ``h``.
        gate: the forward's gate input (pre-activation); ``act(gate)`` is recomputed from it.
        up: the forward's up input.
        activation: "silu", "gelu" or "gelu_tanh".
        inplace: write ``d_gate`` into ``gate`` and ``d_up`` into ``up``, saving two buffers; ``gate`` and
            ``up`` are destroyed and all inputs must be contiguous.

    Returns:
        ``(d_gate, d_up)`` with the inputs' shape and dtype.

    Raises:
        ValueError: see :func:`gated_act_backward_with_h`.
    """
    _, d_gate, d_up = _backward(dh, gate, up, activation, inplace, want_h=False)
    return d_gate, d_up
