#!/usr/bin/env bash
# Build a wheelhouse (a folder of wheels) for installing titan_moe on an air-gapped GPU host.
#
# Runs `pip download --only-binary=:all:` for the target interpreter and platform, so the wheels
# match the host rather than this machine, then builds a wheel of titan_moe itself. torch is left
# out by default because the GPU host normally has its own CUDA build; the torch-dependent
# packages (torchtitan, torchdata) are then downloaded without dependencies and their other
# dependencies are listed explicitly, so pip never resolves torch.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/build_wheelhouse.sh OUT_DIR [options]

  --python-version X.Y   interpreter of the offline host (default: 3.12, the H200 host's)
  --platform TAG         wheel platform tag, repeatable (default: manylinux_2_28_x86_64);
                         manylinux_2_N_ARCH also accepts older manylinux tags of ARCH
  --with-torch [SPEC]    also download torch; SPEC starts with "torch" (e.g. torch==2.11.0)
  --torch-index-url URL  index for torch wheels, e.g. https://download.pytorch.org/whl/cu130
  --no-self              do not build the titan_moe wheel
  -h, --help             show this help

On the offline host:  pip install --no-index --find-links OUT_DIR -r OUT_DIR/requirements.txt
EOF
}

# Packages whose metadata requires torch: downloaded with --no-deps unless --with-torch.
TORCH_DEPENDENT=(torchtitan==0.2.2 torchdata==0.11.0)
# Everything else titan_moe needs at runtime, plus the non-torch requirements of the above.
RUNTIME=(
    torchao==0.18.0 fla-core==0.6.0 datasets tyro docstring-parser shtab typeguard dill
    multiprocess tokenizers tensorboard numpy
    tomli fsspec einops pillow urllib3 requests
)

PYTHON="${PYTHON:-python3}"
OUT_DIR=""
PY_VERSION="3.12"
PLATFORMS=()
TORCH_SPEC=""
TORCH_INDEX_URL=""
BUILD_SELF=1

while (($#)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --python-version) PY_VERSION="${2:?--python-version needs a value}"; shift 2 ;;
        --platform) PLATFORMS+=("${2:?--platform needs a value}"); shift 2 ;;
        --with-torch)
            if [[ $# -ge 2 && "$2" == torch* ]]; then TORCH_SPEC="$2"; shift 2
            else TORCH_SPEC="torch"; shift; fi ;;
        --torch-index-url) TORCH_INDEX_URL="${2:?--torch-index-url needs a value}"; shift 2 ;;
        --no-self) BUILD_SELF=0; shift ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *)
            if [[ -n "$OUT_DIR" ]]; then echo "only one OUT_DIR allowed" >&2; exit 2; fi
            OUT_DIR="$1"; shift ;;
    esac
done

if [[ -z "$OUT_DIR" ]]; then usage >&2; exit 2; fi
if ((${#PLATFORMS[@]} == 0)); then PLATFORMS=(manylinux_2_28_x86_64); fi

# pip matches --platform tags literally; a manylinux_2_N host also runs manylinux_2_M (M < N),
# manylinux2014 (= 2_17), manylinux2010 (= 2_12) and manylinux1 (= 2_5) wheels.
PLATFORM_ARGS=()
for tag in "${PLATFORMS[@]}"; do
    PLATFORM_ARGS+=(--platform "$tag")
    if [[ "$tag" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
        glibc="${BASH_REMATCH[1]}"
        arch="${BASH_REMATCH[2]}"
        for ((minor = glibc - 1; minor >= 5; minor--)); do
            PLATFORM_ARGS+=(--platform "manylinux_2_${minor}_${arch}")
        done
        if ((glibc >= 17)); then PLATFORM_ARGS+=(--platform "manylinux2014_${arch}"); fi
        if ((glibc >= 12)); then PLATFORM_ARGS+=(--platform "manylinux2010_${arch}"); fi
        PLATFORM_ARGS+=(--platform "manylinux1_${arch}")
    fi
done

mkdir -p "$OUT_DIR"
DOWNLOAD=("$PYTHON" -m pip download --only-binary=:all: --dest "$OUT_DIR"
    --python-version "$PY_VERSION" --implementation cp "${PLATFORM_ARGS[@]}")

echo "== wheels for CPython $PY_VERSION on ${PLATFORMS[*]} -> $OUT_DIR"
if [[ -n "$TORCH_SPEC" ]]; then
    TORCH_ARGS=()
    if [[ -n "$TORCH_INDEX_URL" ]]; then TORCH_ARGS=(--extra-index-url "$TORCH_INDEX_URL"); fi
    "${DOWNLOAD[@]}" "${TORCH_ARGS[@]}" "$TORCH_SPEC" "${TORCH_DEPENDENT[@]}" "${RUNTIME[@]}"
else
    "${DOWNLOAD[@]}" --no-deps "${TORCH_DEPENDENT[@]}"
    "${DOWNLOAD[@]}" "${RUNTIME[@]}"
fi

REQUIREMENTS=("${TORCH_DEPENDENT[@]}" "${RUNTIME[@]}")
if [[ -n "$TORCH_SPEC" ]]; then REQUIREMENTS=("$TORCH_SPEC" "${REQUIREMENTS[@]}"); fi
if ((BUILD_SELF)); then
    REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [[ ! -f "$REPO_ROOT/pyproject.toml" && ! -f "$REPO_ROOT/setup.py" ]]; then
        echo "no pyproject.toml in $REPO_ROOT: cannot build the titan_moe wheel (or --no-self)" >&2
        exit 1
    fi
    # Build from a copy of the checkout's files so setuptools' build/ and *.egg-info stay out of
    # the source tree.
    SRC_COPY="$(mktemp -d)"
    trap 'rm -rf "$SRC_COPY"' EXIT
    git -C "$REPO_ROOT" ls-files -z --cached --others --exclude-standard \
        | (cd "$REPO_ROOT" && tar --null -T - -cf -) | tar -xf - -C "$SRC_COPY"
    "$PYTHON" -m pip wheel --no-deps --wheel-dir "$OUT_DIR" "$SRC_COPY"
    REQUIREMENTS=(titan_moe "${REQUIREMENTS[@]}")
fi
printf '%s\n' "${REQUIREMENTS[@]}" >"$OUT_DIR/requirements.txt"

echo
echo "== $(find "$OUT_DIR" -name '*.whl' | wc -l) wheels in $OUT_DIR. On the offline host run:"
echo "  pip install --no-index --find-links $OUT_DIR -r $OUT_DIR/requirements.txt"
if [[ -z "$TORCH_SPEC" ]]; then
    echo "(torch is not included: the host's own CUDA torch must already be installed)"
fi
