#!/bin/sh
# Recording reset command for tests: appends its arguments to $1 and never touches a GPU.
out="$1"; shift
echo "$@" >> "$out"
echo "recorded reset of GPU $*"
