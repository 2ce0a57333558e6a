#!/usr/bin/env bash
# deploy/arm64/need.sh COMMAND PACKAGE...: install the Debian PACKAGEs with apt when COMMAND is not on
# PATH (as root, as CI runs; otherwise say what to install and fail).
set -euo pipefail
command=${1:?usage: $0 COMMAND PACKAGE...}
shift
if command -v "$command" >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "$0: $command is missing: install the Debian package(s) $* (apt-get install $*)" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
