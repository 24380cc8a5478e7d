#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) every wheel that the GPU benchmark run needs and the GPU image lacks, for
# Python 3.12 / x86-64 / torch 2.11+cu130 / transformers 5.17. Run here (with internet), then carry .whl to the
# GPU machine; run_gpu.sh installs it with `pip install --no-index --no-deps --target /tmp/site`.
#
#   bash benchmarks/fetch_wheels.sh            # all wheels
#   bash benchmarks/fetch_wheels.sh core       # loralei + PEFT/bnb + Liger only (no Unsloth stack)
#   bash benchmarks/fetch_wheels.sh gptq       # PEFT on a GPTQ checkpoint (bench_train_step's peft-gptq)
#   bash benchmarks/fetch_wheels.sh axolotl    # Axolotl's LoRA kernels (bench_train_step's axolotl-lora / -dora)
#
# Versions, and why (each one read off the wheel's METADATA Requires-Dist; the image's package list is in the
# device notes, KINDS.md):
#   unsloth / unsloth_zoo 2026.10.9  allow transformers <=5.17.0 (the image's), trl <=1.15.0, datasets <5.
#   trl 1.15.0, datasets 4.8.5       newest that unsloth allows; unsloth imports both at import time.
#   dill 0.4.1, multiprocess 0.70.19 newest that datasets 4.8.5 allows (dill <0.4.2, multiprocess <0.70.20).
#   bitsandbytes 0.50.2              has libbitsandbytes_cuda130.so; Unsloth's loader needs it even for bf16.
#   torchao 0.18.0                   its C++ extensions load on torch >= 2.11.0 (its own import check).
#   liger-kernel 0.8.5               needs only torch and triton.
#   pydantic 2.14.4 (+ pydantic-core 2.50.5, annotated-types, typing-inspection, typing-extensions): loralei's
#       config; the image has none of them but typing-extensions, whose version is unknown there while
#       pydantic wants >=4.16, so a known one travels too.
# Not carried, although listed as requirements: xformers (0.0.35 does not load with torch 2.11; Unsloth falls
# back to SDPA), and Unsloth's lazily imported extras (tyro, diffusers, hf_transfer, msgspec, structlog, json5,
# cut_cross_entropy): nothing on the benchmark's path imports them.
# gptq (the peft-gptq row: Transformers' GPTQ loader needs optimum and gptqmodel, PEFT's GPTQ LoRA layer gptqmodel):
#   gptqmodel 7.6.0                  the newest that allows torch 2.11 and transformers 5.17 (7.6.0: torch >=2.8,
#       transformers >=5.14; 7.7.0 wants torch >=2.14.1 and transformers >=5.20.2); PEFT 0.21 wants >=7.0.0.
#       PyPI has only its sdist: built here into a pure-Python wheel (BUILD_CUDA_EXT=0; its setup.py compiles
#       nothing, its CUDA kernels are sources that it JIT-builds only for the kernels that need them). The row
#       picks its Triton kernel (torch's on CPU), which trains; the CUDA-extension kernels (Marlin, ExLlama v2,
#       Machete...) do not, and are never built.
#   optimum 2.3.0                    Transformers 5.17's GPTQ quantizer converts the model through optimum.gptq
#       (>=1.24 for it and for PEFT); needs only transformers, torch, numpy, huggingface_hub.
#   logbar 0.4.15, device-smi 0.5.7, tokenicer 0.0.14, defuser 0.0.28: imported by `import gptqmodel`; sdists
#       only, pure Python, built here like gptqmodel.
#   pypcre 0.6.4                     imported by `import gptqmodel` (its logger); an sdist with a C extension
#       that links the system's libpcre2-8.so.0 (its pcre2.h is bundled). We have no Python 3.12 to build a
#       cp312 wheel here, so its sdist travels in .whl/src/ and run_gpu.sh builds it there, offline (seen on the
#       image, 2026-12-04: gcc, /usr/include/python3.12/Python.h, libpcre2-8.so.0, setuptools 81), with the
#       setuptools wheel in .whl/src/ (pypcre wants >=79) so that the build does not depend on the image's one.
#   Not carried, although gptqmodel lists them: datasets and dill (imported only to calibrate, i.e. quantize, a
#       model; loading and training a GPTQ model never imports them), maturin (a build tool), torchao (core
#       carries it; the GPTQ path does not import it), and numpy ==2.2.6 (an exact pin; the image's numpy 2.5
#       serves). The image already has accelerate, safetensors, threadpoolctl, protobuf, pillow, requests, jinja2,
#       ninja, pyarrow, tqdm, huggingface_hub.
#   Checked on CPU: the tiny peft-gptq row trained with exactly these, the image's transformers 5.17.0, peft 0.21.0,
#   huggingface_hub 1.33.0 and tokenizers 0.23.2, and without datasets, dill, torchao (torch 2.13 CPU, Python 3.11).
# axolotl (the axolotl-* rows: its LoRA kernel patches on a PEFT model):
#   axolotl 0.19.0                   the newest; its METADATA pins transformers ==5.16.1, peft ==0.20.0, trl, datasets,
#       W&B... (the image has transformers 5.17, peft 0.21): installed without its dependencies. The rows import
#       only its kernels and kernel patches (kernels/, monkeypatch/lora_kernels.py), which need addict, accelerate
#       (the image's), bitsandbytes and torchao (core carries them); bench_rows loads the one helper they take from
#       its trainer-callbacks package without that package's __init__ (W&B, evaluate, datasets, pandas).
#   addict 2.4.0                     Axolotl's config dict.
#   Checked on CPU: the tiny axolotl-lora / axolotl-dora rows trained with exactly these (torch 2.13 CPU,
#   transformers 5.25, peft 0.21; its MLP kernel allocates on CUDA only, so there the MLP stayed PEFT's).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
mkdir -p "$dest"
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux1_x86_64)
core=(liger-kernel==0.8.5 torchao==0.18.0 bitsandbytes==0.50.2 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.7.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
unsloth=(unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1
  multiprocess==0.70.19)
gptq=(optimum==2.3.0)
gptq_sdists=(gptqmodel==7.6.0 logbar==0.4.15 device-smi==0.5.7 tokenicer==0.0.14 defuser==0.0.28)
gptq_src=(pypcre==0.6.4 setuptools==80.9.0)  # built on the GPU machine (see above)
axolotl=(axolotl==0.19.0 addict==2.4.0)
case ${1:-all} in
  core) wanted=("${core[@]}") ;;
  unsloth) wanted=("${unsloth[@]}" bitsandbytes==0.50.2) ;;
  gptq) wanted=("${gptq[@]}") ;;
  axolotl) wanted=("${axolotl[@]}") ;;
  all) wanted=("${core[@]}" "${unsloth[@]}" "${gptq[@]}" "${axolotl[@]}") ;;
  *) echo "usage: $0 [all|core|unsloth|gptq|axolotl]" >&2; exit 2 ;;
esac

download() {  # one pinned wheel for cp312 / manylinux x86-64, without its dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]/#/--platform=}" -d "$dest" "$1"
}

build_pure() {  # a pure-Python wheel built from the pinned sdist (PyPI has no wheel), in pip's build isolation
  BUILD_CUDA_EXT=0 python3 -m pip wheel -q --no-deps -w "$dest" "$1"
}

# Rewrites a wheel without the members matching the given regex (and their RECORD lines), so pip still
# installs it: RECORD must list exactly the files present, with their hashes.
strip_wheel() {
  local wheel=$1 drop=$2
  python3 - "$wheel" "$drop" <<'EOF'
import re, sys, zipfile, os
path, drop = sys.argv[1], re.compile(sys.argv[2])
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
    for info in src.infolist():
        if drop.search(info.filename):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            kept = [l for l in data.decode().splitlines() if l and not drop.search(l.split(",")[0])]
            data = ("\n".join(kept) + "\n").encode()
        out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(tmp, path)
EOF
}

# One version of each package: pip refuses an install that has two.
rm -f "$dest"/*.whl
rm -rf "$dest/src"
for spec in "${wanted[@]}"; do download "$spec"; done
if [[ ${1:-all} = gptq || ${1:-all} = all ]]; then
  for spec in "${gptq_sdists[@]}"; do build_pure "$spec"; done
  python3 -m pip download -q --no-deps -d "$dest/src" "${gptq_src[0]}"  # its sdist: PyPI has no wheel
  download "${gptq_src[1]}" && mv "$dest"/setuptools-*.whl "$dest/src/"
fi
for w in "$dest"/bitsandbytes-*.whl; do
  [ -e "$w" ] && strip_wheel "$w" 'libbitsandbytes_(cuda1[0-2][0-9]|rocm|xpu)[^/]*\.so$'
done
for w in "$dest"/unsloth-*.whl; do  # the Studio web app (front end and server) is no part of the library
  [ -e "$w" ] && strip_wheel "$w" '^studio/'
done
find "$dest" -maxdepth 2 -type f -printf '%s %p\n' | sort -k2 \
  | awk '{ printf "%8.2f MiB  %s\n", $1 / 2^20, $2; t += $1 } END { printf "total: %.2f MiB\n", t / 2^20 }'
