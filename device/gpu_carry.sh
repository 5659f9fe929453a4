# Sourced by the gpu_*_prepare.sh scripts: what every device call carries, made here where pip can download.
#   carry_wheels ASSET_DIR [EXTRA_WHEEL_SPEC ...]
# ignores .whl/ and ASSET_DIR through .git/info/exclude, then fills .whl/ afresh with the wheels a bare GPU box
# lacks (datasets, evaluate, dill, multiprocess; httpx2 + httpcore2 + truststore, which hf_fedtask.export.hub
# imports; peft at the version pinned here; any extra specs) and hf_fedtask itself, built from this working
# tree (its hf_fedtask.model_cards is a mapped package that PYTHONPATH=. cannot import).
carry_wheels() {
  local assets="$1"; shift
  local exclude
  exclude="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")"
  for path in /.whl/ "/$assets/"; do
    grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"
  done
  local wheels=() name
  for name in datasets evaluate dill multiprocess httpx2 httpcore2 truststore peft; do
    wheels+=("$name==$(python3 -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")")
  done
  wheels+=("$@")
  rm -rf .whl && mkdir .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${wheels[@]}"
  # hf_fedtask from a copy of the files that travel (pip would leave build/ and egg-info in the tree)
  local src
  src="$(mktemp -d)"
  git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$src"
  python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "$src"
  rm -rf "$src"
}
