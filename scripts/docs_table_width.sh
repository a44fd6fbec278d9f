#!/usr/bin/env bash
# Measures, in headless Chromium (Debian's `chromium` package) at a 1280 px wide
# window, whether the docs' "Choosing an objective" table fits its text column: the
# table's scroll width against its client width, and every formula or literal that
# sticks out of its cell. Prints one line per table, one per cell that overflows;
# exits 1 when the objectives' table overflows. Usage: bash scripts/docs_table_width.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mktemp -d)"
sphinx-build -q -b html docs/source "$out" > /dev/null
cat > "$out/measure.html" <<'HTML'
<html><body><iframe id="f" src="objectives.html" style="width:1280px;height:900px;border:0"></iframe>
<pre id="out">pending</pre>
<script>
document.getElementById('f').onload = function () {
  setTimeout(function () {
    var d = document.getElementById('f').contentDocument, res = [];
    d.querySelectorAll('.bd-article table').forEach(function (t, i) {
      res.push('table ' + i + ': scrollWidth ' + t.scrollWidth + ', clientWidth ' + t.clientWidth);
      t.querySelectorAll('td, th').forEach(function (c) {
        c.querySelectorAll('mjx-container, code').forEach(function (m) {
          var over = m.getBoundingClientRect().right - c.getBoundingClientRect().right;
          if (over > 1) res.push('  overflow ' + Math.round(over) + ' px: ' + c.textContent.slice(0, 40));
        });
      });
    });
    document.getElementById('out').textContent = res.join('\n');
  }, 1500);
};
</script></body></html>
HTML
python3 -m http.server 8766 --directory "$out" > /dev/null 2>&1 &
server=$!
trap 'kill $server' EXIT
sleep 1
result="$(chromium --headless --no-sandbox --disable-gpu --window-size=1400,1000 \
    --virtual-time-budget=10000 --dump-dom "http://127.0.0.1:8766/measure.html" 2> /dev/null \
    | sed -n '/<pre id="out">/,/<\/pre>/p' | sed 's/<[^>]*>//g')"
echo "$result"
first="$(echo "$result" | grep -m1 '^table 0')"
scroll="$(echo "$first" | sed -E 's/.*scrollWidth ([0-9]+).*/\1/')"
client="$(echo "$first" | sed -E 's/.*clientWidth ([0-9]+).*/\1/')"
[ "$scroll" -le $((client + 1)) ] && ! echo "$result" | grep -q overflow
