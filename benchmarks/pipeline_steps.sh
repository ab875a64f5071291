# Sourced by the pipeline benchmarks (vf_vs_builtin.sh, vf_calculator.sh), from the repository root: the venv's
# asyncrl on PATH, no hub, and `step`, which skips a stage whose output exists (rm the output to rerun it).
BIN=${BIN:-.venv/bin}
export PATH="$PWD/$BIN:$PATH" HF_HUB_OFFLINE=1
step() {  # step OUTPUT COMMAND...: run COMMAND unless OUTPUT exists
  local out=$1
  shift
  [[ -e "$out" ]] || "$@"
}
