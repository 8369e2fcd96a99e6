#!/usr/bin/env bash
# Fails when proto/ breaks the v1 API against the last commit (buf breaking, rules in
# proto/buf.yaml), so generated clients never break by accident.
#   scripts/check_breaking.sh            # auto: uncommitted proto/ changes against HEAD,
#                                        # a clean tree's HEAD against the commit before it
#   scripts/check_breaking.sh REF        # against any git ref (e.g. origin/main, v1.0.0)
# Passes, saying why, when there is nothing to compare with (no earlier commit with proto/,
# or a shallow clone that lacks it).
set -euo pipefail

root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
BUF=${BUF:-}
if [ -z "$BUF" ]; then
  if [ -x .venv/bin/buf ]; then BUF=.venv/bin/buf; else BUF=$(command -v buf || true); fi
fi
if [ -z "$BUF" ]; then
  echo "check_breaking: buf not found (pip install buf-bin, or set BUF)" >&2
  exit 2
fi

has_proto() { git rev-parse --verify --quiet "$1:proto/buf.yaml" >/dev/null 2>&1; }

against=${1:-}
if [ -z "$against" ]; then
  if ! git rev-parse --verify --quiet HEAD >/dev/null; then
    echo "check_breaking: no commit yet; nothing to compare with"
    exit 0
  fi
  if [ -n "$(git status --porcelain --untracked-files=all -- proto)" ]; then
    against=HEAD
  else
    against=HEAD~1
  fi
fi

if ! git rev-parse --verify --quiet "$against^{commit}" >/dev/null; then
  if [ "$(git rev-parse --is-shallow-repository)" = true ]; then
    echo "check_breaking: $against is not in this shallow clone; nothing to compare with"
    exit 0
  fi
  if [ -z "${1:-}" ]; then
    echo "check_breaking: no commit before HEAD; nothing to compare with"
    exit 0
  fi
  echo "check_breaking: unknown ref $against" >&2
  exit 2
fi
if ! has_proto "$against"; then
  echo "check_breaking: $against has no proto/; nothing to compare with"
  exit 0
fi

commit=$(git rev-parse "$against^{commit}")
# buf reads the commit out of the local repository (no network); depth covers old refs.
depth=$(( $(git rev-list --count "$commit..HEAD" 2>/dev/null || echo 0) + 2 ))
echo "check_breaking: proto/ against $against (${commit:0:12})"
"$BUF" breaking proto --against ".git#ref=$commit,depth=$depth,subdir=proto"
echo "check_breaking: no breaking change"
