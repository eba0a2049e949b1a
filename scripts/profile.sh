#!/usr/bin/env bash
# Record a py-spy flame graph of one Relay process, found by its title.
#   scripts/profile.sh sched 10        -> profile-sched.svg (relay::sched, 10 seconds)
#   scripts/profile.sh tp0             -> profile-tp0.svg (30 seconds)
set -euo pipefail
name=${1:?usage: scripts/profile.sh NAME [SECONDS]   (NAME: http, tokenizer, sched, tp0, tp1, ..., detok)}
seconds=${2:-30}
pid=$(pgrep -f "^relay::${name}\$" | head -n 1 || true)
if [ -z "$pid" ]; then
  echo "no process titled relay::${name}; running: $(pgrep -af '^relay::' | awk '{print $2}' | tr '\n' ' ')" >&2
  exit 1
fi
command -v py-spy >/dev/null || python -m pip install py-spy
out="profile-${name}.svg"
py-spy record --pid "$pid" --duration "$seconds" --rate 200 --subprocesses --output "$out"
echo "wrote $out"
