#!/usr/bin/env bash
# What a new user meets first, and the package as pip builds it. CI runs this after the tests
# (.ci/run); any failing step fails it. Four parts, each timed:
#
#   readme  the README's run command (the ```sh block under "## The two commands", `.venv`
#           moved into the work folder, nothing else changed) from the checkout, with a fresh
#           LORAPLEX_DATA_DIR and a free LORAPLEX_PORT: wait for /readyz, run the curl line and
#           the openai snippet that `serve` printed, as printed, check their answers; SIGTERM:
#           graceful shutdown, exit status 0, no process left. Then pip check, every
#           module imports and every command answers --help (scripts/check_install.py), from
#           outside the checkout.
#   dist    sdist, then the wheel from it (`python -m build`, installed in a venv of its own),
#           from a copy of the checkout's files; both hold every module, admin_ui/ and
#           migrations/ (scripts/smoke_checks.py dist).
#   wheel   the wheel in a fresh venv, run from outside the checkout: the same checks,
#           `loraplex db upgrade` on a fresh SQLite file, then `loraplex generate` on the demo
#           model that part readme converted (same data dir).
#   docker  the Dockerfile's COPY steps and its pip RUN steps (requirements from pyproject,
#           then `pip install --no-deps .`) in a fresh venv: the same checks.
#
# The parts run at once where nothing orders them (it saves CI minutes): dist and docker start
# with readme, each in a background job with its output in its own log (part-*.log, printed
# when the job ends); wheel follows dist in dist's job and waits for part readme only before
# `generate`, which needs readme's converted model and its server gone. A part that fails
# fails the smoke, named, with its output's last lines (at once if it ends during readme's
# wait for /readyz); each part's time and start are printed.
#
# LORAPLEX_SMOKE_KEEP=1 keeps the work folder; LORAPLEX_SMOKE_READY_S (default 900) bounds the
# wait for the first /readyz (install, demo conversion, two demo adapters trained).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CHECKS=("python3" "$REPO/scripts/smoke_checks.py")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/loraplex-smoke.XXXXXX")
DATA=$WORK/data
OUTSIDE=$WORK/outside  # commands that must not see the checkout run from here
mkdir -p "$DATA" "$OUTSIDE"
# The smoke's own knobs, read before every LORAPLEX_* variable leaves the environment.
KEEP=${LORAPLEX_SMOKE_KEEP:-}
READY_S=${LORAPLEX_SMOKE_READY_S:-900}
while read -r name; do unset "$name"; done < <(compgen -e | grep '^LORAPLEX_' || true)
T0=$SECONDS
part=""
part_t0=$SECONDS
timings=()
shell_pid=""
declare -A bg_pid=()  # background job (its parts' names) -> its pid, until reaped

say() { echo "-- smoke [$((SECONDS - T0))s] $*"; }
fail() {  # in a background part this ends that part's job; the main shell reports it
  echo "smoke: FAIL: $*" >&2
  exit 1
}
begin() {  # name: close the running part's clock, start this one's
  [[ -z $part ]] || timings+=("$part $((SECONDS - part_t0))s")
  part=$1
  part_t0=$SECONDS
  echo "== smoke [$((SECONDS - T0))s] part $part"
}

tree_of() {  # pid: it and its descendants
  local c
  echo "$1"
  for c in $(pgrep -P "$1" || true); do tree_of "$c"; done
}
cleanup() {
  local rc=$? pids name
  # The background parts' jobs first (a job's bash shows no work-folder path), then whatever
  # still uses the work folder: only processes this script started do.
  pids=$(for name in "${!bg_pid[@]}"; do tree_of "${bg_pid[$name]}"; done)
  pids+=" $(pgrep -f "$WORK/" || true)"
  if [[ -n ${pids// /} ]]; then
    kill -TERM $pids 2>/dev/null || true
    sleep 2
    kill -KILL $pids 2>/dev/null || true
  fi
  if ((rc != 0)); then
    echo "smoke: FAILED in part ${part:-setup} after $((SECONDS - T0))s" >&2
    if [[ $part == readme && -f $WORK/serve.log ]]; then
      echo "--- the last lines of the README command's output:" >&2
      tail -n 40 "$WORK/serve.log" >&2
    fi
  fi
  if [[ $KEEP == 1 ]]; then
    echo "smoke: kept $WORK"
  else
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

pipq() {  # pip-install args: quiet, less the notes about index folders a machine lacks
  "$@" 2>&1 | { grep -v "^WARNING: Location 'file:.*' is ignored" || true; }
}
fresh_venv() {  # dir
  python3 -m venv "$1"
  pipq "$1/bin/pip" install -q -U pip
}
check_venv() {  # venv: its requirements hold, every module imports, every command starts
  say "pip check; imports and --help in $1"
  "$1/bin/pip" check
  (cd "$OUTSIDE" && "$1/bin/python" "$REPO/scripts/check_install.py" "$REPO/pyproject.toml")
}
serve_pid_of() {  # shell pid: the `loraplex serve` process it runs (itself, or a child)
  local p
  for p in "$1" $(pgrep -P "$1" || true); do
    if ps -o args= -p "$p" | grep -q 'bin/loraplex serve'; then
      echo "$p"
      return
    fi
  done
  fail "no \`loraplex serve\` process under pid $1"
}

start_parts() {  # name function [name function ...]: one background job runs them in turn
  local job="" i
  for ((i = 1; i <= $#; i += 2)); do job+=${job:++}${!i}; done
  local log=$WORK/part-$job.log
  echo "== smoke [$((SECONDS - T0))s] part ${job//+/, then } in the background" \
    "(output in part-$job.log)"
  (
    trap - EXIT
    while (($#)); do
      part=$1
      part_t0=$SECONDS
      echo "== smoke [$((SECONDS - T0))s] part $part"
      "$2"
      echo "$part $((SECONDS - part_t0))s (from $((part_t0 - T0))s)" >> "$WORK/part-$job.times"
      shift 2
    done
  ) > "$log" 2>&1 < /dev/null &
  bg_pid[$job]=$!
}
reap() {  # job: wait for it, print its output; a failed part fails the smoke, named
  local job=$1 rc=0 failed
  wait "${bg_pid[$job]}" || rc=$?
  unset "bg_pid[$job]"
  echo "== smoke [$((SECONDS - T0))s] the background job $job ended (status $rc); its output:"
  sed 's/^/   | /' "$WORK/part-$job.log"
  [[ ! -f $WORK/part-$job.times ]] \
    || mapfile -t -O "${#timings[@]}" timings < "$WORK/part-$job.times"
  if ((rc != 0)); then
    failed=$(grep -o '^== smoke \[[0-9]*s\] part [a-z]*' "$WORK/part-$job.log" | tail -n 1)
    part=${failed##* }
    echo "--- the last lines of part $part's output (part-$job.log):" >&2
    tail -n 30 "$WORK/part-$job.log" >&2
    fail "part $part failed (status $rc)"
  fi
}
reap_ended() {  # every background job that has ended
  local job
  for job in "${!bg_pid[@]}"; do
    kill -0 "${bg_pid[$job]}" 2>/dev/null || reap "$job"
  done
}

command -v curl > /dev/null || fail "curl is needed (the printed curl line uses it)"

say "a copy of the checkout's files (tracked, and untracked ones git does not ignore)"
mkdir "$WORK/src"
git -C "$REPO" ls-files -z --cached --others --exclude-standard \
  | (cd "$REPO" && tar --null -T - --ignore-failed-read -cf - 2>/dev/null) \
  | tar -xf - -C "$WORK/src"

# ---------------------------------------------------------------------------------------------
part_dist() {
  fresh_venv "$WORK/tools-venv"
  pipq "$WORK/tools-venv/bin/pip" install -q build
  say "python -m build (the sdist, then the wheel from the sdist)"
  "$WORK/tools-venv/bin/python" -m build --outdir "$WORK/dist" "$WORK/src" > "$WORK/build.log" 2>&1 \
    || { tail -n 30 "$WORK/build.log" >&2; fail "python -m build failed"; }
  tail -n 1 "$WORK/build.log"
  "${CHECKS[@]}" dist "$WORK/src" "$WORK/dist"
}

# ---------------------------------------------------------------------------------------------
part_wheel() {
  local venv=$WORK/wheel-venv marker converted text
  fresh_venv "$venv"
  pipq "$venv/bin/pip" install -q "$WORK"/dist/*.whl
  check_venv "$venv"
  cd "$OUTSIDE"
  "$venv/bin/python" -c 'import sys, loraplex.platform.cli as m; assert m.__file__.startswith(sys.prefix), m.__file__'
  say "loraplex db upgrade on a fresh SQLite file"
  LORAPLEX_DATA_DIR=$WORK/fresh LORAPLEX_DATABASE_URL=sqlite:///$WORK/fresh/fresh.db \
    "$venv/bin/loraplex" db upgrade
  "${CHECKS[@]}" db-head "$WORK/fresh/fresh.db" "$REPO/migrations"
  say "waiting for part readme (generate reads its converted demo model, its server gone)"
  until [[ -e $WORK/readme.done ]]; do
    kill -0 $$ 2>/dev/null || fail "the smoke ended before part readme did"
    sleep 1
  done
  marker=$DATA/models/gemma-3-270m/.complete
  [[ -f $marker ]] || fail "part readme left no converted demo model in $DATA"
  converted=$(stat -c %Y "$marker")
  say "loraplex generate on the demo model (the data dir of part readme)"
  LORAPLEX_DATA_DIR=$DATA "$venv/bin/loraplex" generate "The capital of France is" \
    > "$WORK/generate.out" 2> "$WORK/generate.err" \
    || { tail -n 20 "$WORK/generate.err" >&2; fail "loraplex generate failed"; }
  cat "$WORK/generate.out"
  tail -n 1 "$WORK/generate.err"
  text=$(cat "$WORK/generate.out")
  [[ $text == "The capital of France is"?* ]] || fail "generate printed no continuation of the prompt"
  [[ $(stat -c %Y "$marker") == "$converted" ]] || fail "generate converted the demo model again"
}

# ---------------------------------------------------------------------------------------------
part_docker() {
  local venv=$WORK/docker-venv
  fresh_venv "$venv"
  "${CHECKS[@]}" docker "$REPO/Dockerfile" "$WORK/src" "$WORK/docker" > "$WORK/docker.sh"
  say "the Dockerfile's steps in $venv (pip output in docker.log)"
  PATH="$venv/bin:$PATH" bash "$WORK/docker.sh" > "$WORK/docker.log" 2>&1 \
    || { tail -n 30 "$WORK/docker.log" >&2; fail "the Dockerfile's pip steps failed"; }
  grep -E '^(\+ |  \(not run\)|\(/src)' "$WORK/docker.log"
  [[ ! -e $WORK/docker/src ]] || fail "the Dockerfile's clean-up step did not run"
  check_venv "$venv"
}

start_parts dist part_dist wheel part_wheel
start_parts docker part_docker

# ---------------------------------------------------------------------------------------------
begin readme
venv=$WORK/readme-venv
cmd=$("${CHECKS[@]}" readme-run "$REPO/README.md" "$venv")
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
say "in $REPO with LORAPLEX_DATA_DIR=$DATA LORAPLEX_PORT=$port: $cmd"
(cd "$REPO" && LORAPLEX_DATA_DIR=$DATA LORAPLEX_PORT=$port exec bash -c "$cmd") \
  > "$WORK/serve.log" 2>&1 &
shell_pid=$!
deadline=$((SECONDS + READY_S))
next_note=$((SECONDS + 60))
until curl -sf "http://127.0.0.1:$port/readyz" > /dev/null 2>&1; do
  if ! kill -0 "$shell_pid" 2>/dev/null; then
    rc=0
    wait "$shell_pid" || rc=$?
    fail "the README's command ended (status $rc) before /readyz answered"
  fi
  ((SECONDS < deadline)) || fail "no /readyz within ${READY_S}s"
  reap_ended  # a background part that failed meanwhile fails the smoke now
  if ((SECONDS >= next_note)); then
    say "waiting for /readyz: $(tail -c 300 "$WORK/serve.log" | tr '\r' '\n' | grep -a . | tail -n 1)"
    next_note=$((SECONDS + 60))
  fi
  sleep 1
done
serve_pid=$(serve_pid_of "$shell_pid")
say "/readyz answers (server pid $serve_pid)"

"${CHECKS[@]}" snippets "$WORK/serve.log" "$WORK"
say "the curl line, as printed"
(cd "$REPO" && bash "$WORK/curl.sh") > "$WORK/curl.out" 2> "$WORK/curl.err" \
  || { cat "$WORK/curl.err" >&2; fail "the curl line failed"; }
"${CHECKS[@]}" completion "$WORK/curl.out" "$WORK/curl.sh"
say "the openai snippet, as printed"
(cd "$REPO" && bash "$WORK/openai.sh") > "$WORK/openai.out"
grep -q '[^[:space:]]' "$WORK/openai.out" || fail "the openai snippet printed nothing"
echo "openai snippet printed: $(cat "$WORK/openai.out")"
(cd "$REPO" && bash "$WORK/openai_json.sh") > "$WORK/openai.json"
"${CHECKS[@]}" chat "$WORK/openai.json" "$WORK/openai.sh" "$WORK/curl.sh"

say "SIGTERM to loraplex serve"
kill -TERM "$serve_pid"
for _ in $(seq 60); do
  kill -0 "$shell_pid" 2>/dev/null || break
  sleep 1
done
kill -0 "$shell_pid" 2>/dev/null && fail "the server still runs 60 s after SIGTERM"
rc=0
wait "$shell_pid" || rc=$?
shell_pid=""
# Clean: status 0 once the graceful shutdown is done (serve keeps uvicorn from re-raising the
# signal it handled, which would read as 128 + 15 here).
((rc == 0)) || fail "the README's command ended with status $rc after SIGTERM"
grep -q 'Application shutdown complete' "$WORK/serve.log" || fail "the app's shutdown did not run"
! grep -n 'Traceback' "$WORK/serve.log" || fail "the server's output holds a traceback"
sleep 1
left=$(pgrep -f "$venv/" || true)
[[ -z $left ]] || fail "processes of the server outlived it: $(ps -o pid=,args= -p "${left//$'\n'/,}")"
say "clean exit (status $rc, shutdown complete, no traceback, no process left)"
touch "$WORK/readme.done"  # part wheel's generate may run now
check_venv "$venv"
timings+=("$part $((SECONDS - part_t0))s")

part="dist, wheel or docker (background)"
for job in "${!bg_pid[@]}"; do reap "$job"; done
echo "smoke: passed in $((SECONDS - T0))s (${timings[*]})"
