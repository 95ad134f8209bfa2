#!/usr/bin/env bash
# Note [Config choices] (core/config.hpp): a closed-choice key reaches the code as an enum,
# parsed once in the schema (core/config/). Fails when code outside the schema compares a
# config choice with a string literal again:
#   - <section>.<field> ==/!= "..." (either side) for every enum field of core/config.hpp,
#   - <x>.<field> ==/!= "..." through a section alias (t.precision) for the fields whose names
#     nothing else uses,
#   - a spelling compared with a literal (cfg::spelling(...) == "...", tokenizer.kind() == "...").
#   tests/lint/config_choices.sh [SOURCE_ROOT]
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
cd "$root"
header=core/config.hpp
dirs=(worker launcher comm checkpoint cluster coordinator bench)

# "section field" for each `cfg::Type field` member of the section structs.
mapfile -t fields < <(awk '
  /^struct [A-Za-z]+Config \{/ {
    s = $2; sub(/Config$/, "", s); section = tolower(s); next
  }
  /^\};/ { section = "" }
  section != "" && $1 ~ /^cfg::/ { f = $2; sub(/;$/, "", f); print section, f }
' "$header")
if [ "${#fields[@]}" -lt 20 ]; then
  echo "config_choices: found only ${#fields[@]} enum fields in $header; the parser needs updating" >&2
  exit 2
fi

# Field names that mean other things too (a file's format, a tokenizer's kind, a log level...)
# are checked only with their section.
generic=" kind format level device backend task resume compression batch_size pooling "
qualified=() aliased=()
for entry in "${fields[@]}"; do
  section="${entry% *}" field="${entry#* }"
  qualified+=("\\b${section}\\.${field}\\b")
  case "$generic" in *" $field "*) ;; *) aliased+=("\\.${field}\\b") ;; esac
done
join() { local IFS='|'; echo "$*"; }
q="($(join "${qualified[@]}"))" a="($(join "${aliased[@]}"))"
literal='"[^"]*"'
patterns=(
  "${q}[[:space:]]*[!=]=[[:space:]]*\""
  "${literal}[[:space:]]*[!=]=[[:space:]]*[A-Za-z_][A-Za-z_0-9.>()-]*${q}"
  "${a}[[:space:]]*[!=]=[[:space:]]*\""
  "${literal}[[:space:]]*[!=]=[[:space:]]*[A-Za-z_][A-Za-z_0-9.>()-]*${a}"
  "spelling\\([^()]*(\\([^()]*\\))?[^()]*\\)[[:space:]]*[!=]=[[:space:]]*\""
  "${literal}[[:space:]]*[!=]=[[:space:]]*(cfg::)?spelling\\("
  "\\.kind\\(\\)[[:space:]]*[!=]=[[:space:]]*\""
)
hits=""
for p in "${patterns[@]}"; do
  # Comment lines are skipped: messages and notes quote the spellings.
  hits+="$(grep -rnE --include='*.cpp' --include='*.hpp' --include='*.h' --include='*.cu' \
             "$p" "${dirs[@]}" | grep -vE '^[^:]+:[0-9]+:[[:space:]]*//' || true)"$'\n'
done
hits="$(printf '%s' "$hits" | sed '/^$/d' | sort -t: -k1,1 -k2,2n -u)"
if [ -n "$hits" ]; then
  echo "$hits"
  echo "config_choices: a config choice is compared with a string literal above; compare the" \
       "enum (cfg::..., core/config.hpp) instead: see Note [Config choices]" >&2
  exit 1
fi
echo "config_choices: ${#fields[@]} enum fields, no string comparison in ${dirs[*]}"
