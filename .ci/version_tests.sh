#!/usr/bin/env bash
# .ci/version_tests.txt as pytest's arguments, one a line (the phases on other torch versions read them):
#   bash .ci/version_tests.sh paths      # the test files
#   bash .ci/version_tests.sh deselect   # --deselect=<node id> for each '-' line
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=.ci/version_tests.txt
case "${1:-}" in
  paths) grep -v '^[#-]' "$LIST" | grep . ;;
  deselect) sed -n 's/^-\(.*\)$/--deselect=\1/p' "$LIST" ;;
  *) echo "usage: bash .ci/version_tests.sh paths | deselect" >&2; exit 2 ;;
esac
