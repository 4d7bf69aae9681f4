#!/usr/bin/env bash
# An emulated cluster on one machine: N "nodes" as Linux network namespaces,
# joined by a switch through links of a set bandwidth, with what Open MPI needs
# to launch one job across them (a hostfile, a launcher agent, MCA settings).
# Ranks on one node talk through shared memory; ranks on different nodes
# through TCP over the shaped links (docs/cluster.md).
#
#   scripts/cluster.sh up     [--nodes N] [--slots K] [--rate R] [--delay D] [--name NAME]
#                             [--dir DIR] [--subnet A.B.C.0/24]
#   scripts/cluster.sh shape  --rate R [--delay D] [--node I] [--name NAME | --dir DIR]
#   scripts/cluster.sh link   I up|down                     [--name NAME | --dir DIR]
#   scripts/cluster.sh status                               [--name NAME | --dir DIR]
#   scripts/cluster.sh down                                 [--name NAME | --dir DIR]
#
# Defaults: 2 nodes, K = max(1, nproc / N) slots per node, links of 1gbit each
# way, no added delay, NAME "lattice", subnet 10.77.0.0/24, DIR
# ${TMPDIR:-/tmp}/NAME-cluster. Rates are tc's (100mbit, 1gbit, 10gbit...),
# or "none" for an unshaped link.
#
# The layout (why a switch in a namespace of its own rather than veth pairs
# between the nodes: one NIC, one address and one shaper per node whatever N
# is, like a rack behind a top-of-rack switch, where pairs would need N-1
# interfaces and routes per node; and with the switch in its own namespace the
# machine's own namespace gets no interface, address or route of the cluster,
# so nothing outside can address it and no cluster packet can leave):
#
#   NAME-switch : bridge br0 with ports port0..portN-1 (each shaped towards its node)
#   NAME-nodeI  : lo, eth0 = A.B.C.(I+1)/24 (shaped towards the switch), hostname nodeI
#
# The state directory holds:
#   cluster.conf   what `up` made (read by shape, link, status, down)
#   hostfile       "nodeI slots=K" for mpirun --hostfile
#   hosts          the nodes' names and addresses; each node's /etc/hosts through
#                  /etc/netns/NAME-nodeI/hosts (ip netns exec mounts it)
#   on             DIR/on nodeI CMD ARGS...: runs a command on a node
#   agent          Open MPI's plm_rsh_agent: called as ssh would be (agent HOST WORDS...)
#   env            the MCA settings as OMPI_MCA_* variables (source it)
#   mca.conf       the same as an MCA parameter file (mpirun --tune DIR/mca.conf)
#   mpirun         DIR/mpirun ARGS...: mpirun on node0 with the hostfile and settings
#
# Exit status: 0 done; 2 usage; 77 this machine cannot host the cluster (not
# root, no network namespaces, no bridge or tbf, the subnet in use, a delay
# without netem), with the reason on stderr; 1 anything else. status exits
# 0 when the cluster is up, 3 when it is down, 1 when it is broken.
set -Eeuo pipefail

die() { echo "cluster.sh: $*" >&2; exit 1; }
usage() { echo "cluster.sh: $*" >&2; echo "usage: scripts/cluster.sh up|shape|link|status|down [options] (see the header of scripts/cluster.sh)" >&2; exit 2; }
# While `up` builds (making=1), a refusal first removes what it made.
making=0
cannot_what="cannot make the cluster here"
cannot() {
  echo "cluster.sh: $cannot_what: $*" >&2
  if [[ $making -eq 1 ]]; then making=0; cmd_down >/dev/null 2>&1 || true; fi
  exit 77
}

cmd="${1:-}"
[[ -n "$cmd" ]] || usage "no command given"
shift

nodes=2 slots="" rate=1gbit delay=0ms name="" dir="" subnet=10.77.0.0/24 only_node=""
rate_given=0 delay_given=0 link_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) nodes="${2:?--nodes needs a number}"; shift ;;
    --slots) slots="${2:?--slots needs a number}"; shift ;;
    --rate) rate="${2:?--rate needs a rate such as 1gbit}"; rate_given=1; shift ;;
    --delay) delay="${2:?--delay needs a time such as 1ms}"; delay_given=1; shift ;;
    --name) name="${2:?--name needs a name}"; shift ;;
    --dir) dir="${2:?--dir needs a directory}"; shift ;;
    --subnet) subnet="${2:?--subnet needs A.B.C.0/24}"; shift ;;
    --node) only_node="${2:?--node needs a node number}"; shift ;;
    -h|--help) sed -n '2,/^set -Eeuo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) usage "unknown option '$1' (valid: --nodes, --slots, --rate, --delay, --name, --dir, --subnet, --node)" ;;
    *) link_args+=("$1") ;;
  esac
  shift
done

# ---- the cluster's identity: name, state directory -------------------------

if [[ -z "$dir" ]]; then
  dir="${TMPDIR:-/tmp}/${name:-lattice}-cluster"
fi
# A cluster made earlier: its state says what it is; --name must agree.
if [[ "$cmd" != up && -f "$dir/cluster.conf" ]]; then
  saved_name="$(sed -n 's/^name=//p' "$dir/cluster.conf")"
  [[ -z "$name" || "$name" == "$saved_name" ]] ||
    usage "--name $name disagrees with the cluster in $dir (named $saved_name)"
  name="$saved_name"
  nodes="$(sed -n 's/^nodes=//p' "$dir/cluster.conf")"
  subnet="$(sed -n 's/^subnet=//p' "$dir/cluster.conf")"
fi
name="${name:-lattice}"
# Every namespace this script makes is NAME-switch or NAME-nodeI, and NAME
# starts with "lattice": nothing else on the machine is ever touched.
[[ "$name" =~ ^lattice[a-z0-9-]{0,40}$ ]] ||
  usage "--name '$name' is invalid: it must start with 'lattice' and use only a-z, 0-9 and '-' (at most 47 characters)"
[[ "$nodes" =~ ^[0-9]+$ && "$nodes" -ge 1 && "$nodes" -le 64 ]] || usage "--nodes '$nodes' is invalid: 1 to 64"
if [[ -n "$slots" ]]; then
  [[ "$slots" =~ ^[0-9]+$ && "$slots" -ge 1 ]] || usage "--slots '$slots' is invalid: a positive number of ranks per node"
fi
[[ "$subnet" =~ ^([0-9]+)\.([0-9]+)\.([0-9]+)\.0/24$ ]] ||
  usage "--subnet '$subnet' is invalid: give a /24 such as 10.77.0.0/24"
net_prefix="${BASH_REMATCH[1]}.${BASH_REMATCH[2]}.${BASH_REMATCH[3]}"
switch_ns="$name-switch"
node_ns() { echo "$name-node$1"; }
node_addr() { echo "$net_prefix.$(($1 + 1))"; }

# ---- checks ------------------------------------------------------------------

require_root_and_netns() {
  [[ $(id -u) -eq 0 ]] || cannot "it needs root (network namespaces, veth, tc); run it as root or with sudo"
  command -v ip >/dev/null 2>&1 || cannot "'ip' (iproute2) is not installed"
  command -v tc >/dev/null 2>&1 || cannot "'tc' (iproute2) is not installed"
  command -v unshare >/dev/null 2>&1 || cannot "'unshare' (util-linux) is not installed"
  ip netns list >/dev/null 2>&1 || cannot "'ip netns' does not work here: $(ip netns list 2>&1 | head -1)"
}

# The rate in bytes per second, from tc's units.
rate_bytes_per_s() {
  local r="$1" num unit
  [[ "$r" =~ ^([0-9]+(\.[0-9]+)?)([a-zA-Z]*)$ ]] || return 1
  num="${BASH_REMATCH[1]}" unit="${BASH_REMATCH[3],,}"
  local mult
  case "$unit" in
    bit) mult=0.125 ;; kbit) mult=125 ;; mbit) mult=125000 ;; gbit) mult=125000000 ;; tbit) mult=125000000000 ;;
    bps) mult=1 ;; kbps) mult=1000 ;; mbps) mult=1000000 ;; gbps) mult=1000000000 ;;
    *) return 1 ;;
  esac
  awk -v n="$num" -v m="$mult" 'BEGIN { v = n * m; if (v < 1000) exit 1; printf "%.0f\n", v }'
}

check_rate_and_delay() {
  if [[ "$rate" != none ]]; then
    rate_bytes_per_s "$rate" >/dev/null ||
      usage "--rate '$rate' is invalid: a tc rate of at least 8kbit such as 100mbit, 1gbit, 10gbit, or 'none'"
  fi
  [[ "$delay" =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]] || usage "--delay '$delay' is invalid: a time such as 0ms, 500us, 2ms"
}

delay_is_zero() { [[ "$delay" =~ ^0+(\.0+)?(us|ms|s)$ ]]; }

# Refuses a subnet that this machine's own namespace already has an address
# or a route in (other than the default route): the cluster's addresses must
# be its own, unmistakable for anything real.
check_subnet_free() {
  local base cidr addr bits net mask lo hi
  base=$(ip_to_int "$net_prefix.0")
  while read -r cidr; do
    [[ -z "$cidr" || "$cidr" == default ]] && continue
    addr="${cidr%/*}" bits="${cidr#*/}"
    [[ "$cidr" == */* ]] || bits=32
    [[ "$addr" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || continue
    net=$(ip_to_int "$addr")
    # The two ranges [base, base+255] and the cidr's overlap?
    if [[ "$bits" -eq 0 ]]; then continue; fi
    mask=$(( (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF ))
    lo=$(( net & mask )) hi=$(( (net & mask) | (~mask & 0xFFFFFFFF) ))
    if (( lo <= base + 255 && hi >= base )); then
      cannot "subnet $subnet is in use on this machine ($cidr in 'ip addr' or 'ip route'); choose another with --subnet"
    fi
  done < <(ip -o -4 addr show | awk '{print $4}'; ip -4 route show table all 2>/dev/null | awk '{print $1}' | grep -v -E '^(broadcast|local|unreachable|prohibit|blackhole)$' || true)
}

ip_to_int() {
  local IFS=. a b c d
  read -r a b c d <<<"$1"
  echo $(( (a << 24) | (b << 16) | (c << 8) | d ))
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }

# ---- shaping -----------------------------------------------------------------

# Shapes the egress of DEV in namespace NS: a token bucket at the rate (burst
# of 1 ms of traffic, at least 64 KiB so a full-size segment of the veth's
# offloads passes whole; a queue of 100 ms), and under it netem's delay when
# one is asked for (needs sch_netem, which not every kernel has).
shape_dev() {
  local ns="$1" dev="$2"
  tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
  if [[ "$rate" == none ]]; then
    if ! delay_is_zero; then
      tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$delay" ||
        cannot "this kernel has no netem qdisc (sch_netem): --delay is unavailable here; rate shaping still works"
    fi
    return
  fi
  local bps burst
  bps=$(rate_bytes_per_s "$rate")
  burst=$(( bps / 1000 )); (( burst >= 65536 )) || burst=65536
  if delay_is_zero; then
    tc -n "$ns" qdisc add dev "$dev" root handle 1: tbf rate "$rate" burst "$burst" latency 100ms ||
      cannot "tc cannot add a tbf qdisc (sch_tbf) here"
  else
    # netem holds each packet for the delay, then the token bucket under it
    # paces them at the rate (the recipe of tc-netem(8), "rate control").
    tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$delay" ||
      cannot "this kernel has no netem qdisc (sch_netem): --delay is unavailable here; use --delay 0ms (rate shaping still works)"
    tc -n "$ns" qdisc add dev "$dev" parent 1:1 handle 10: tbf rate "$rate" burst "$burst" latency 100ms ||
      cannot "tc cannot add a tbf qdisc (sch_tbf) under netem here"
  fi
}

# Refuses a delay when the kernel has no netem, before any link is touched:
# the probe is a netem qdisc on the switch namespace's loopback.
check_delay_possible() {
  delay_is_zero && return 0
  tc -n "$switch_ns" qdisc add dev lo root netem delay "$delay" 2>/dev/null ||
    cannot "this kernel has no netem qdisc (sch_netem): --delay is unavailable here; use --delay 0ms (rate shaping with tbf still works)"
  tc -n "$switch_ns" qdisc del dev lo root 2>/dev/null || true
}

shape_node() {
  local i="$1"
  shape_dev "$(node_ns "$i")" eth0       # node -> switch
  shape_dev "$switch_ns" "port$i"        # switch -> node
}

# ---- files -------------------------------------------------------------------

write_files() {
  mkdir -p "$dir"
  local i
  {
    echo "name=$name"
    echo "nodes=$nodes"
    echo "slots=$slots"
    echo "subnet=$subnet"
    echo "rate=$rate"
    echo "delay=$delay"
  } >"$dir/cluster.conf"

  : >"$dir/hostfile"
  for ((i = 0; i < nodes; i++)); do echo "node$i slots=$slots" >>"$dir/hostfile"; done

  { echo "127.0.0.1 localhost"
    for ((i = 0; i < nodes; i++)); do echo "$(node_addr "$i") node$i"; done
  } >"$dir/hosts"
  for ((i = 0; i < nodes; i++)); do
    mkdir -p "/etc/netns/$(node_ns "$i")"
    cp "$dir/hosts" "/etc/netns/$(node_ns "$i")/hosts"
  done

  # DIR/on HOST CMD ARGS...: runs CMD inside the node's namespace, with the
  # node's name as hostname (a UTS namespace of its own), keeping the
  # arguments as they are. HOST is nodeI, its address, or NAME-nodeI.
  cat >"$dir/on" <<EOF
#!/bin/sh
# Made by scripts/cluster.sh for the cluster '$name'.
host="\$1"
[ -n "\$host" ] || { echo "usage: \$0 HOST CMD [ARGS...]" >&2; exit 2; }
shift
case "\$host" in
$(for ((i = 0; i < nodes; i++)); do echo "  node$i|$(node_addr "$i")|$(node_ns "$i")) ns=$(node_ns "$i") node=node$i ;;"; done)
  *) echo "$dir/on: '\$host' is not a node of the cluster '$name' (nodes: node0..node$((nodes - 1)))" >&2; exit 255 ;;
esac
exec ip netns exec "\$ns" unshare --uts -- sh -c 'hostname "\$0" && exec "\$@"' "\$node" "\$@"
EOF
  # DIR/agent HOST WORDS...: what Open MPI's rsh launcher calls in place of
  # ssh; like ssh, it joins the words and has a shell run them on the host.
  cat >"$dir/agent" <<EOF
#!/bin/sh
# Made by scripts/cluster.sh for the cluster '$name': Open MPI's plm_rsh_agent.
while [ \$# -gt 0 ]; do
  case "\$1" in -*) shift ;; *) break ;; esac   # ssh options, if any
done
host="\$1"
shift
exec "$dir/on" "\$host" sh -c "\$*"
EOF
  # The MCA settings. plm_rsh_agent: launch through the namespaces; the
  # if_include pair: the out-of-band channel (mpirun <-> daemons) and the
  # TCP transport use the cluster's links only; btl: shared memory (vader)
  # inside a node, TCP between nodes, self for a rank to itself; keepalive:
  # an idle daemon connection to a node that is gone fails within 25 s
  # (Open MPI's default is 300 s + 9 x 20 s).
  {
    echo "plm_rsh_agent = $dir/agent"
    echo "oob_tcp_if_include = $subnet"
    echo "btl_tcp_if_include = $subnet"
    echo "btl = self,vader,tcp"
    echo "oob_tcp_keepalive_time = 10"
    echo "oob_tcp_keepalive_intvl = 5"
    echo "oob_tcp_keepalive_probes = 3"
  } >"$dir/mca.conf"
  {
    echo "# Made by scripts/cluster.sh for the cluster '$name': source it, then"
    echo "# $dir/on node0 mpirun --hostfile $dir/hostfile ..."
    echo "export OMPI_MCA_plm_rsh_agent='$dir/agent'"
    echo "export OMPI_MCA_oob_tcp_if_include=$subnet"
    echo "export OMPI_MCA_btl_tcp_if_include=$subnet"
    echo "export OMPI_MCA_btl=self,vader,tcp"
    echo "export OMPI_MCA_oob_tcp_keepalive_time=10 OMPI_MCA_oob_tcp_keepalive_intvl=5 OMPI_MCA_oob_tcp_keepalive_probes=3"
    echo "# Open MPI refuses root unless told it is intended (the cluster needs root)."
    echo "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
  } >"$dir/env"
  cat >"$dir/mpirun" <<EOF
#!/bin/sh
# Made by scripts/cluster.sh for the cluster '$name': mpirun on node0 (the
# head node) over the cluster's hostfile, with the MCA settings of $dir/env.
. "$dir/env"
exec "$dir/on" node0 mpirun --hostfile "$dir/hostfile" "\$@"
EOF
  chmod +x "$dir/on" "$dir/agent" "$dir/mpirun"
}

# ---- commands ----------------------------------------------------------------

# The processes still inside a namespace of the cluster (a job that failed,
# a daemon left behind): ended before the namespace goes.
kill_in_namespaces() {
  local ns pids
  for ns in "$@"; do
    ns_exists "$ns" || continue
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [[ -n "${pids// /}" ]] || continue
    kill -TERM $pids 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
      [[ -n "${pids// /}" ]] || break
      sleep 0.2
    done
    [[ -z "${pids// /}" ]] || kill -KILL $pids 2>/dev/null || true
  done
}

# Every namespace of this name (whatever node count made them).
cluster_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${name}-(switch|node[0-9]+)\$" || true
}

cmd_down() {
  require_root_and_netns
  local nss ns
  nss=$(cluster_namespaces)
  # shellcheck disable=SC2086
  kill_in_namespaces $nss
  for ns in $nss; do
    ip netns del "$ns" 2>/dev/null || die "cannot delete the namespace $ns: $(ip netns del "$ns" 2>&1)"
    [[ "$ns" == "$switch_ns" ]] || rm -rf "/etc/netns/$ns"
  done
  rm -rf /etc/netns/"$name"-node[0-9]* 2>/dev/null || true
  rmdir /etc/netns 2>/dev/null || true
  if [[ -f "$dir/cluster.conf" ]]; then
    rm -f "$dir"/{cluster.conf,hostfile,hosts,on,agent,env,mca.conf,mpirun}
    rmdir "$dir" 2>/dev/null || true
  fi
  echo "cluster '$name' is down"
}

cluster_complete() {
  [[ -f "$dir/cluster.conf" ]] || return 1
  [[ "$(sed -n 's/^nodes=//p' "$dir/cluster.conf")" == "$nodes" ]] || return 1
  [[ "$(sed -n 's/^subnet=//p' "$dir/cluster.conf")" == "$subnet" ]] || return 1
  [[ "$(cluster_namespaces | wc -l)" -eq $((nodes + 1)) ]] || return 1
  local i
  for ((i = 0; i < nodes; i++)); do
    ip -n "$(node_ns "$i")" -4 addr show dev eth0 2>/dev/null | grep -q "inet $(node_addr "$i")/24" || return 1
  done
}

cmd_up() {
  require_root_and_netns
  check_rate_and_delay
  if [[ -z "$slots" ]]; then
    slots=$(( $(nproc) / nodes )); (( slots >= 1 )) || slots=1
  fi
  local i ns
  if cluster_complete; then
    echo "cluster '$name' is already up: applying the links' shape and rewriting $dir"
    check_delay_possible
  else
    # Leftovers of an earlier cluster of this name (a failed up, another
    # node count) go first.
    if [[ -n "$(cluster_namespaces)" ]]; then
      echo "cluster.sh: removing what is left of an earlier cluster '$name'"
      cmd_down >/dev/null
    fi
    check_subnet_free
    making=1
    trap 'echo "cluster.sh: up failed; removing what it made" >&2; cmd_down >/dev/null 2>&1 || true' ERR
    ip netns add "$switch_ns" 2>/dev/null || cannot "'ip netns add $switch_ns' fails: $(ip netns add "$switch_ns" 2>&1)"
    ip -n "$switch_ns" link set lo up
    check_delay_possible
    ip -n "$switch_ns" link add br0 type bridge forward_delay 0 stp_state 0 2>/dev/null ||
      cannot "the kernel cannot make a bridge (CONFIG_BRIDGE)"
    ip -n "$switch_ns" link set br0 up
    for ((i = 0; i < nodes; i++)); do
      ns=$(node_ns "$i")
      ip netns add "$ns"
      ip -n "$ns" link set lo up
      ip -n "$switch_ns" link add "port$i" type veth peer name eth0 netns "$ns" 2>/dev/null ||
        cannot "the kernel cannot make a veth pair (CONFIG_VETH)"
      ip -n "$switch_ns" link set "port$i" master br0
      ip -n "$switch_ns" link set "port$i" up
      ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
      ip -n "$ns" link set eth0 up
      # A connection whose peer is gone (a cut link, a dead node) fails after
      # ~13 s of retransmissions instead of Linux's default ~15 minutes, so
      # mpirun notices a lost daemon and ends the job (docs/cluster.md).
      ip netns exec "$ns" sysctl -qw net.ipv4.tcp_retries2=5
    done
  fi
  for ((i = 0; i < nodes; i++)); do shape_node "$i"; done
  trap - ERR
  making=0
  write_files
  local shape="$rate each way"
  [[ "$rate" == none ]] && shape="unshaped"
  delay_is_zero || shape="$shape, $delay added delay"
  echo "cluster '$name' is up: $nodes nodes x $slots slots on $subnet, links $shape"
  for ((i = 0; i < nodes; i++)); do
    echo "  node$i  $(node_addr "$i")  (namespace $(node_ns "$i"))"
  done
  local n=$((nodes * slots))
  echo "run a job from node0 (the head node), e.g. $n ranks:"
  echo "  $dir/mpirun -n $n build/lattice bench comm"
  echo "which is:"
  echo "  source $dir/env"
  echo "  $dir/on node0 mpirun --hostfile $dir/hostfile -n $n build/lattice bench comm"
  echo "or, every setting on the command line (as root, with OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1):"
  echo "  $dir/on node0 mpirun --hostfile $dir/hostfile --mca plm_rsh_agent $dir/agent \\"
  echo "    --mca oob_tcp_if_include $subnet --mca btl_tcp_if_include $subnet --mca btl self,vader,tcp \\"
  echo "    --mca oob_tcp_keepalive_time 10 --mca oob_tcp_keepalive_intvl 5 --mca oob_tcp_keepalive_probes 3 \\"
  echo "    -n $n build/lattice bench comm"
  echo "change the links: scripts/cluster.sh shape --rate 100mbit$( [[ "$name" == lattice ]] || echo " --name $name")"
  echo "remove it:        scripts/cluster.sh down$( [[ "$name" == lattice ]] || echo " --name $name")"
}

need_cluster() {
  [[ -f "$dir/cluster.conf" ]] ||
    die "no cluster '$name' here ($dir/cluster.conf is missing): scripts/cluster.sh up first"
  local i
  for ((i = 0; i < nodes; i++)); do
    ns_exists "$(node_ns "$i")" || die "the cluster '$name' is broken ($(node_ns "$i") is missing): run down, then up"
  done
}

cmd_shape() {
  cannot_what="cannot shape the links here"
  require_root_and_netns
  need_cluster
  [[ $rate_given -eq 1 || $delay_given -eq 1 ]] || usage "shape needs --rate R (and/or --delay D)"
  # What is not given stays as it was.
  [[ $rate_given -eq 1 ]] || rate="$(sed -n 's/^rate=//p' "$dir/cluster.conf")"
  [[ $delay_given -eq 1 ]] || delay="$(sed -n 's/^delay=//p' "$dir/cluster.conf")"
  check_rate_and_delay
  check_delay_possible
  local i
  if [[ -n "$only_node" ]]; then
    [[ "$only_node" =~ ^[0-9]+$ && "$only_node" -lt "$nodes" ]] ||
      usage "--node '$only_node' is invalid: 0 to $((nodes - 1))"
    shape_node "$only_node"
    echo "node$only_node's link: $rate, delay $delay"
  else
    for ((i = 0; i < nodes; i++)); do shape_node "$i"; done
    sed -i "s/^rate=.*/rate=$rate/; s/^delay=.*/delay=$delay/" "$dir/cluster.conf"
    echo "every link: $rate, delay $delay"
  fi
}

cmd_link() {
  require_root_and_netns
  need_cluster
  [[ ${#link_args[@]} -eq 2 ]] || usage "link needs a node and a state: link I up|down"
  local i="${link_args[0]#node}" state="${link_args[1]}"
  [[ "$i" =~ ^[0-9]+$ && "$i" -lt "$nodes" ]] || usage "link: node '${link_args[0]}' is invalid: 0 to $((nodes - 1))"
  [[ "$state" == up || "$state" == down ]] || usage "link: state '$state' is invalid: up or down"
  # The switch's port: the node keeps its address, its cable is pulled.
  ip -n "$switch_ns" link set "port$i" "$state"
  echo "node$i's link is $state"
}

cmd_status() {
  require_root_and_netns
  if [[ ! -f "$dir/cluster.conf" ]]; then
    local left
    left=$(cluster_namespaces | tr '\n' ' ')
    if [[ -n "$left" ]]; then
      echo "cluster '$name': no state in $dir, but namespaces are left: $left(scripts/cluster.sh down --name $name)"
      exit 1
    fi
    echo "cluster '$name' is down"
    exit 3
  fi
  # shellcheck disable=SC1091
  local conf_slots conf_rate conf_delay
  conf_slots=$(sed -n 's/^slots=//p' "$dir/cluster.conf")
  conf_rate=$(sed -n 's/^rate=//p' "$dir/cluster.conf")
  conf_delay=$(sed -n 's/^delay=//p' "$dir/cluster.conf")
  echo "cluster '$name' ($dir): $nodes nodes x $conf_slots slots on $subnet, links $conf_rate, delay $conf_delay"
  local i ns ok=1 state procs qdisc
  for ((i = 0; i < nodes; i++)); do
    ns=$(node_ns "$i")
    if ! ns_exists "$ns"; then echo "  node$i  MISSING (namespace $ns)"; ok=0; continue; fi
    state=$(ip -n "$switch_ns" -br link show "port$i" 2>/dev/null | awk '{print $2}')
    procs=$(ip netns pids "$ns" 2>/dev/null | wc -l)
    qdisc=$(tc -n "$ns" -s qdisc show dev eth0 | awk '/^qdisc tbf/ {printf "tbf %s", $8} /^qdisc netem/ {printf "netem %s ", $0} / Sent / {printf ", sent %s bytes, dropped %s", $2, $7}' | tr -d ',' | sed 's/ sent/, sent/; s/ dropped/, dropped/')
    echo "  node$i  $(node_addr "$i")  link ${state:-?}  ${qdisc:-unshaped}  processes $procs"
  done
  [[ $ok -eq 1 ]] || exit 1
}

case "$cmd" in
  up) cmd_up ;;
  down) cmd_down ;;
  shape) cmd_shape ;;
  link) cmd_link ;;
  status) cmd_status ;;
  -h|--help|help) sed -n '2,/^set -Eeuo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
  *) usage "unknown command '$cmd' (valid: up, down, shape, link, status)" ;;
esac
