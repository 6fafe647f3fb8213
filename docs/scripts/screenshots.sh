#!/usr/bin/env bash
# Render the built site's home page and one API reference page with headless Chromium (Debian's package
# `chromium`) into docs/images/site_home.png and docs/images/site_api_strategies.png, to look at them as a reader
# would. Needs the docs extra (pip install -e ".[docs]") and /usr/bin/chromium (apt-get install chromium).
#
#   bash docs/scripts/screenshots.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
chromium="${CHROMIUM:-/usr/bin/chromium}"

(cd "$root" && NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet --site-dir "$work/site")

shoot() {  # page (relative to the site), output PNG, window height
    # No network here or in CI: the background-networking flags keep Chromium from dialling out at start.
    "$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$work/profile" --hide-scrollbars --window-size="1280,$3" \
        --screenshot="$2" "file://$work/site/$1" >/dev/null 2>&1
    test -s "$2"
    echo "wrote ${2#"$root"/}"
}

shoot index.html "$root/docs/images/site_home.png" 1000
shoot reference/strategies/index.html "$root/docs/images/site_api_strategies.png" 1400
