#!/usr/bin/env bash
# Two "nodes" on one machine: a tp2×dp2 plan of examples/llama-tiny.toml on 4 ranks, 2 per node,
# through `megac launch --hostfile ... --deterministic`, must give the same losses and gradient
# norms, bit for bit, as the local-thread run of the same plan.
#
# Each node is a network namespace with its own hostname (a UTS namespace), joined to the
# other by a veth pair (10.231.7.1 and 10.231.7.2 on the veth only, nothing else is used);
# mpirun starts the remote node's daemon through an ssh stand-in (`ip netns exec NS unshare
# --uts ...`, see shared/setup/dependencies.md §3 and §8). Needs root, iproute2 and unshare;
# if the namespaces cannot be made the script fails (it never skips). Everything it creates
# (namespaces, veth, temporary files, processes left in the namespaces) is removed on exit,
# failure included.
#
# Usage: scripts/two-nodes.sh [STEPS]   (MEGAC=path/to/megac to use a given binary, built with
# --features mpi; scripts/test.sh passes the one its tests built)
set -euo pipefail
cd "$(dirname "$0")/.."

steps=${1:-3}
tag=$$
ns_a=megac-node-a-$tag
ns_b=megac-node-b-$tag
veth_a=mgA$tag
veth_b=mgB$tag
veth_a=${veth_a:0:15}
veth_b=${veth_b:0:15}
ip_a=10.231.7.1
ip_b=10.231.7.2
tmp=$(mktemp -d /tmp/megac-two-nodes.XXXXXX)

die() {
  echo "two-nodes: FAILED: $*" >&2
  exit 1
}

cleanup() {
  local rc=$?
  set +e
  for ns in "$ns_a" "$ns_b"; do
    if ip netns list 2>/dev/null | grep -qw "$ns"; then
      # Processes of this run left in the namespace (mpirun, orted, ranks): end them by pid.
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
      ip netns delete "$ns"
    fi
  done
  ip link delete "$veth_a" 2>/dev/null
  rm -rf "$tmp"
  if ((rc == 0)); then echo "two-nodes: cleaned up"; else echo "two-nodes: cleaned up (exit $rc)" >&2; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

[[ $(id -u) == 0 ]] || die "needs root (network namespaces); CI runs as root"
for tool in ip unshare mpirun; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done

if [[ -z ${MEGAC:-} ]]; then
  cargo build --release --features mpi --bin megac
  MEGAC=${CARGO_TARGET_DIR:-$PWD/target}/release/megac
fi
MEGAC=$(realpath "$MEGAC")

echo "== two network namespaces joined by a veth pair"
ip netns add "$ns_a" || die "cannot create network namespace $ns_a"
ip netns add "$ns_b" || die "cannot create network namespace $ns_b"
ip link add "$veth_a" type veth peer name "$veth_b" || die "cannot create a veth pair"
ip link set "$veth_a" netns "$ns_a"
ip link set "$veth_b" netns "$ns_b"
ip -n "$ns_a" addr add "$ip_a/24" dev "$veth_a"
ip -n "$ns_b" addr add "$ip_b/24" dev "$veth_b"
for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
ip -n "$ns_a" link set "$veth_a" up
ip -n "$ns_b" link set "$veth_b" up
ip netns exec "$ns_a" ip route get "$ip_b" >/dev/null || die "no route from $ns_a to $ip_b"

# The ssh stand-in: `nsrsh.sh HOST COMMAND...` runs COMMAND in HOST's namespace, under the
# node's own hostname, as ssh would on that node.
cat >"$tmp/nsrsh.sh" <<EOF
#!/usr/bin/env bash
host=\$1; shift
case \$host in
  $ip_a|nodeA) ns=$ns_a; name=nodeA ;;
  $ip_b|nodeB) ns=$ns_b; name=nodeB ;;
  *) echo "nsrsh.sh: unknown host \$host" >&2; exit 255 ;;
esac
exec ip netns exec "\$ns" unshare --uts bash -c "hostname \$name; \$*"
EOF
chmod +x "$tmp/nsrsh.sh"
printf '%s slots=2\n%s slots=2\n' "$ip_a" "$ip_b" >"$tmp/hostfile"

echo "== plan: llama-tiny, tp2 x dp2"
plan=$tmp/plan
"$MEGAC" compile examples/llama-tiny.toml --set parallel.tp=2 --set parallel.dp=2 \
  --set train.micro_batch=2 --set train.global_batch=8 -o "$plan" >/dev/null

echo "== megac launch -n 4 across the two nodes ($steps steps)"
# mpirun runs in node A; node B's daemon is started through the stand-in. TCP between the
# nodes, on the veth only; ranks waiting in MPI yield their core (4 ranks may share few).
launch="$(printf '%q ' "$MEGAC" launch -n 4 --hostfile "$tmp/hostfile" "$plan" \
  --steps "$steps" --report "$tmp/mpi.json" --deterministic)"
env OMPI_MCA_plm_rsh_agent="$tmp/nsrsh.sh" \
  OMPI_MCA_btl_tcp_if_include=10.231.7.0/24 OMPI_MCA_oob_tcp_if_include=10.231.7.0/24 \
  OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_rmaps_base_display_map=1 \
  RAYON_NUM_THREADS=1 MEGAC_COMM_TIMEOUT=120 \
  timeout 600 ip netns exec "$ns_a" unshare --uts bash -c "hostname nodeA; $launch" \
  2>&1 | tee "$tmp/launch.log" || die "megac launch failed (log above)"
[[ -s $tmp/mpi.json ]] || die "no report from the two-node run"
# Both nodes ran two ranks (mpirun's map, printed by rmaps_base_display_map).
# Node A is mpirun's own (shown by its hostname), node B the one reached through the stand-in.
for node in nodeA "$ip_b"; do
  grep -Eq "Data for node: $node[[:space:]]+Num slots: 2.*Num procs: 2" "$tmp/launch.log" ||
    die "mpirun did not place 2 ranks on $node (log above)"
done

echo "== the same plan on local threads"
"$MEGAC" run "$plan" --comm local --steps "$steps" --report "$tmp/local.json"

echo "== losses and gradient norms, two nodes vs local threads"
pick() { grep -E '"(loss|grad_norm)"' "$1" | tr -d ' ,'; }
paste <(pick "$tmp/mpi.json") <(pick "$tmp/local.json")
[[ $(pick "$tmp/mpi.json" | wc -l) == $((2 * steps)) ]] || die "the report has not $steps steps"
diff <(pick "$tmp/mpi.json") <(pick "$tmp/local.json") >/dev/null ||
  die "the two-node run's losses or gradient norms differ from the local-thread run"
grep -q '"peak_rss_bytes_per_rank"' "$tmp/mpi.json" || die "no per-rank peak memory in the report"
echo "two-nodes: OK: $steps steps of tp2 x dp2 on 2 nodes x 2 ranks, bit-identical to local threads"
