#!/usr/bin/env bash
# The King James Bible as plain text, one verse per line (verse numbers and chapter
# headings dropped), from Debian's bible-kjv and bible-kjv-text packages (public domain):
#   experiments/kjv_text.sh OUT.txt
# The real-model experiments use it as a haystack of real prose; any plain-text book
# (e.g. from Project Gutenberg) can take its place.
set -euo pipefail
OUT=${1:?usage: kjv_text.sh OUT.txt}
[ -s "$OUT" ] && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download bible-kjv bible-kjv-text >/dev/null)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
"$work/root/usr/bin/bible" -p "$work/root/usr/lib" -l 100000 "gen1:1-rev22:21" \
  | sed -E 's/^ *[0-9]+ //' | grep -Ev '^(([0-9] )?[A-Z][A-Za-z ]+ [0-9]+)?$' >"$OUT.part"
mv "$OUT.part" "$OUT"
