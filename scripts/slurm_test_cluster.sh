#!/usr/bin/env bash
# A real Slurm cluster on this machine, for tests and benchmarks.
#
#   scripts/slurm_test_cluster.sh up N [--quick]  # slurmctld + N slurmd (node1..nodeN); prints `export SLURM_CONF=...`
#                                                 # --quick: lost nodes found and requeued jobs started sooner (tests)
#   scripts/slurm_test_cluster.sh status          # what is up, and sinfo
#   scripts/slurm_test_cluster.sh poweroff nodeI  # cut nodeI's link, then SIGKILL every process in its namespace
#   scripts/slurm_test_cluster.sh down            # remove all of it; safe twice, also after a partial `up`
#
# Layout (one cluster per machine; everything it makes is named cks-*):
#
#   bridge cks-br  10.214.K.1/24   slurmctld (root network namespace, listening on 10.214.K.1 only)
#     |-- veth cks-v1 -- netns cks-node1: cks-e1 10.214.K.11, lo   slurmd -N node1 (own UTS + mount namespace)
#     |-- veth cks-v2 -- netns cks-node2: cks-e2 10.214.K.12, lo   slurmd -N node2
#
# State, config, logs and spool live under /run/cks-slurm. Addresses are assigned only to links made here, so no
# traffic leaves the bridge and loopback. munged is started (as user munge) only when none is serving already,
# and `down` stops it only in that case.
#
# Exit status 3: this machine cannot host the cluster (not root, no network namespaces, Slurm not installable);
# 4: `up` found a cluster, or what is left of one, already here (and left it alone).
set -euo pipefail

readonly PREFIX=cks
readonly DIR=/run/${PREFIX}-slurm
readonly CONF=$DIR/slurm.conf
readonly BRIDGE=${PREFIX}-br
readonly PACKAGES=(slurm-wlm slurmctld slurmd slurm-client munge)
readonly READY_TIMEOUT_S=60
export SLURM_CONF=$CONF

log() { printf '[slurm_test_cluster] %s\n' "$*" >&2; }
die() {
	local code=$1
	shift
	log "error: $*"
	exit "$code"
}

netns_name() { echo "${PREFIX}-node$1"; }
host_veth() { echo "${PREFIX}-v$1"; }
node_veth() { echo "${PREFIX}-e$1"; }

# Namespaces and links this script made (also those of a partial `up`).
our_netns() { ip netns list 2>/dev/null | awk -v p="^${PREFIX}-node[0-9]+$" '$1 ~ p {print $1}'; }
our_links() { ip -o link show 2>/dev/null | awk -F': ' -v p="^${PREFIX}-" '{sub(/@.*/, "", $2)} $2 ~ p {print $2}'; }

# Pids of the processes named $1 whose command line names our slurm.conf (found even when no pid file was written).
our_daemon_pids() {
	local pid
	for pid in $(pgrep -x "$1" || true); do
		if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "$CONF"; then echo "$pid"; fi
	done
}

# SIGKILL every process in network namespace $1 (slurmstepd ignores SIGTERM) and wait until none is left.
kill_netns_processes() {
	local ns=$1 pids deadline=$((SECONDS + 10))
	while pids=$(ip netns pids "$ns" 2>/dev/null) && [[ -n $pids ]]; do
		# shellcheck disable=SC2086  # one pid per word
		kill -KILL $pids 2>/dev/null || true
		((SECONDS < deadline)) || die 1 "processes still in $ns after SIGKILL: $pids"
		sleep 0.1
	done
}

# A zombie (this machine's PID 1 does not always reap) counts as gone.
alive() { [[ -r /proc/$1/status ]] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

# SIGKILL the pids and wait until they are gone: nothing here holds state worth a graceful shutdown.
kill_pids() {
	local pid deadline=$((SECONDS + 10))
	(($#)) || return 0
	kill -KILL "$@" 2>/dev/null || true
	for pid in "$@"; do
		while alive "$pid"; do
			((SECONDS < deadline)) || die 1 "pid $pid survives SIGKILL"
			sleep 0.05
		done
	done
}

check_machine() {
	[[ $EUID -eq 0 ]] || die 3 "needs root (network namespaces, links, daemons)"
	unshare --net --uts --mount true 2>/dev/null || die 3 "cannot make network/UTS/mount namespaces here"
	command -v ip >/dev/null || die 3 "needs iproute2 (ip)"
}

ensure_packages() {
	local missing=() pkg
	for pkg in "${PACKAGES[@]}"; do
		dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
	done
	((${#missing[@]})) || return 0
	log "installing ${missing[*]}"
	local install=(apt-get install -y --no-install-recommends "${missing[@]}")
	DEBIAN_FRONTEND=noninteractive "${install[@]}" >"$DIR/log/apt.log" 2>&1 ||
		{ apt-get update >>"$DIR/log/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive "${install[@]}" >>"$DIR/log/apt.log" 2>&1; } ||
		die 3 "could not install ${missing[*]} (see $DIR/log/apt.log)"
}

munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

ensure_munged() {
	local key=/etc/munge/munge.key deadline
	if [[ ! -s $key ]]; then
		install -d -o munge -g munge -m 0700 /etc/munge
		mungekey --create --keyfile="$key" 2>/dev/null || dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
		chown munge:munge "$key"
		chmod 0400 "$key"
	fi
	munge_works && return 0
	[[ -d /run/munge ]] || touch "$DIR/munge-rundir.ours"
	install -d -o munge -g munge -m 0755 /run/munge
	touch "$DIR/munged.ours" # first: a `down` after an interrupted `up` then finds munged by /run/munge/munged.pid
	runuser -u munge -- munged </dev/null >>"$DIR/log/munged.out" 2>&1 || die 1 "munged did not start (see $DIR/log/munged.out)"
	cp /run/munge/munged.pid "$DIR/munged.pid"
	deadline=$((SECONDS + 10))
	until munge_works; do
		((SECONDS < deadline)) || die 1 "munged started but does not answer"
		sleep 0.1
	done
}

# A 10.214.K prefix no interface or route of this machine uses.
free_subnet() {
	local used k
	used=$(ip -4 -o addr show; ip -4 route show table all)
	for k in $(seq 1 254); do
		grep -qF "10.214.$k." <<<"$used" || {
			echo "10.214.$k"
			return 0
		}
	done
	die 1 "no free 10.214.K.0/24"
}

make_network() {
	local n=$1 subnet=$2 i ns
	ip link add "$BRIDGE" type bridge
	sysctl -qw "net.ipv6.conf.$BRIDGE.disable_ipv6=1" 2>/dev/null || true
	ip addr add "$subnet.1/24" dev "$BRIDGE"
	ip link set "$BRIDGE" up
	for ((i = 1; i <= n; i++)); do
		ns=$(netns_name "$i")
		ip netns add "$ns"
		nsenter --net="/run/netns/$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 2>/dev/null || true
		ip link add "$(host_veth "$i")" type veth peer name "$(node_veth "$i")" netns "$ns"
		sysctl -qw "net.ipv6.conf.$(host_veth "$i").disable_ipv6=1" 2>/dev/null || true
		ip link set "$(host_veth "$i")" master "$BRIDGE" up
		ip -n "$ns" addr add "$subnet.$((10 + i))/24" dev "$(node_veth "$i")"
		ip -n "$ns" link set "$(node_veth "$i")" up
		ip -n "$ns" link set lo up
		printf 'node%d %s %s %s\n' "$i" "$subnet.$((10 + i))" "$ns" "$(host_veth "$i")" >>"$DIR/nodes"
	done
}

# The controller's port: 6817 unless something already listens there.
free_port() {
	local port
	for port in $(seq 6817 6899); do
		ss -Hltn "sport = :$port" | grep -q . || {
			echo "$port"
			return 0
		}
	done
	die 1 "no free port in 6817-6899 for slurmctld"
}

write_config() {
	local subnet=$1 host=$2 port=$3 quick=$4 name addr _ cpus slurmd_timeout=10 message_timeout=10
	local scheduler=batch_sched_delay=0
	cpus=$(($(nproc) < 2 ? $(nproc) : 2)) # more than the machine has and slurmd registers as INVAL
	{
		echo "# Written by scripts/slurm_test_cluster.sh; removed by its \`down\`."
		echo "ClusterName=${PREFIX}"
		echo "SlurmctldHost=$host($subnet.1)"
		echo "SlurmctldPort=$port"
		# The controller listens on the bridge address only, not on every address of this machine.
		echo "CommunicationParameters=NoCtldInAddrAny"
		echo "SlurmUser=root"
		echo "AuthType=auth/munge"
		echo "CryptoType=crypto/munge"
		echo "MpiDefault=none"
		echo "ProctrackType=proctrack/linuxproc"
		echo "TaskPlugin=task/none"
		echo "SelectType=select/cons_tres"
		echo "SelectTypeParameters=CR_CPU"
		echo "AccountingStorageType=accounting_storage/none"
		echo "JobAcctGatherType=jobacct_gather/none"
		echo "JobCompType=jobcomp/none"
		echo "ReturnToService=2"
		# --quick: a node silent for 5 s is down, and a ping of a silent node gives up after 5 s (not 10 s), so a
		# lost node is found in 10-15 s (not 25-40 s); the backfill scheduler, which starts a requeued job, runs
		# every second (not every 30 s).
		if [[ $quick == quick ]]; then
			slurmd_timeout=5
			message_timeout=5
			scheduler+=,bf_interval=1
		fi
		echo "SlurmdTimeout=$slurmd_timeout"
		echo "MessageTimeout=$message_timeout"
		echo "InactiveLimit=0"
		# Slurm's default: a cancelled job's processes have 30 s between SIGTERM and SIGKILL to stop cleanly.
		echo "KillWait=30"
		# A requeued job waits this long before it may start again (default 120 s): a lost coordinator's job is back
		# after SlurmdTimeout + this.
		echo "AuthInfo=cred_expire=10"
		# Finished jobs stay visible to `scontrol show job` for 5 minutes (there is no accounting to ask).
		echo "MinJobAge=300"
		# Start batch jobs at the next scheduler pass (about 1 s), not after the default 3 s delay.
		echo "SchedulerParameters=$scheduler"
		echo "StateSaveLocation=$DIR/ctld"
		echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
		echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
		echo "SlurmdSpoolDir=$DIR/spool/%n"
		echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
		echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
		while read -r name addr _; do
			echo "NodeName=$name NodeAddr=$addr CPUs=$cpus State=UNKNOWN"
		done <"$DIR/nodes"
		echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
	} >"$CONF"
	{
		echo "127.0.0.1 localhost"
		echo "$subnet.1 $host"
		awk '{print $2, $1}' "$DIR/nodes"
	} >"$DIR/hosts"
}

start_slurmctld() {
	local deadline=$((SECONDS + 20))
	# NoCtldInAddrAny binds to the address the host name resolves to: in a mount namespace of its own, slurmctld
	# reads the cluster's hosts file, where that is the bridge address.
	# shellcheck disable=SC2016  # expanded by the inner sh
	unshare --mount sh -c 'mount --bind "$1" /etc/hosts && exec slurmctld -f "$2"' sh "$DIR/hosts" "$CONF" \
		</dev/null >>"$DIR/log/slurmctld.out" 2>&1 || fail_up "slurmctld did not start (see $DIR/log/slurmctld.out)"
	until scontrol ping 2>/dev/null | grep -q 'is UP'; do
		((SECONDS < deadline)) || fail_up "slurmctld does not answer scontrol ping"
		sleep 0.2
	done
}

start_slurmds() {
	local name ns _
	while read -r name _ ns _; do
		# `ip netns exec` would remount /sys, where slurmd then fails: enter the network namespace only, with a UTS
		# namespace for the node's hostname and a mount namespace for its /etc/hosts.
		# shellcheck disable=SC2016  # expanded by the inner sh
		nsenter --net="/run/netns/$ns" unshare --uts --mount sh -c \
			'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -f "$3" -N "$1"' \
			sh "$name" "$DIR/hosts" "$CONF" </dev/null >>"$DIR/log/slurmd-$name.out" 2>&1 ||
			fail_up "slurmd $name did not start (see $DIR/log/slurmd-$name.out)"
	done <"$DIR/nodes"
}

wait_all_idle() {
	local n=$1 deadline=$((SECONDS + READY_TIMEOUT_S)) idle
	while :; do
		idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | sort -u | wc -l)
		((idle == n)) && return 0
		((SECONDS < deadline)) || fail_up "only $idle of $n nodes idle after ${READY_TIMEOUT_S}s"
		sleep 0.2
	done
}

fail_up() {
	log "error: $*"
	sinfo -N 2>&1 | sed 's/^/  sinfo: /' >&2 || true
	log "slurmctld log tail ($DIR/log/slurmctld.log):"
	tail -n 30 "$DIR/log/slurmctld.log" >&2 2>/dev/null || true
	log "the cluster is partly up: run '$0 down'"
	exit 1
}

cmd_up() {
	local n=${1:-} quick=${2:-}
	[[ $n =~ ^[1-9][0-9]*$ && $n -le 200 && ($quick == "" || $quick == --quick) ]] ||
		die 2 "usage: $0 up N [--quick]   (1 <= N <= 200)"
	check_machine
	[[ ! -e $DIR && -z $(our_netns)$(our_links) ]] ||
		die 4 "a cluster (or what is left of one) is already here: run '$0 down' first"
	install -d -m 0755 "$DIR" "$DIR/log" "$DIR/run" "$DIR/ctld" "$DIR/spool"
	: >"$DIR/nodes"
	ensure_packages
	ensure_munged
	local subnet host
	subnet=$(free_subnet)
	host=$(hostname -s)
	make_network "$n" "$subnet"
	write_config "$subnet" "$host" "$(free_port)" "${quick#--}"
	start_slurmctld
	start_slurmds
	wait_all_idle "$n"
	log "$n nodes idle on $subnet.0/24"
	echo "export SLURM_CONF=$CONF"
}

cmd_down() {
	local ns link pids
	for ns in $(our_netns); do kill_netns_processes "$ns"; done
	# A slurmd outside its namespace should not exist, but a partial `up` must not leave one behind.
	mapfile -t pids < <(our_daemon_pids slurmd; our_daemon_pids slurmctld)
	kill_pids "${pids[@]}"
	if [[ -e $DIR/munged.ours ]]; then
		mapfile -t pids < <(cat "$DIR/munged.pid" 2>/dev/null || cat /run/munge/munged.pid 2>/dev/null)
		kill_pids "${pids[@]}"
		# munged restarts cleanly over the socket and lock files a SIGKILL leaves behind.
		[[ ! -e $DIR/munge-rundir.ours ]] || rm -rf /run/munge
	fi
	for ns in $(our_netns); do ip netns del "$ns"; done
	for link in $(our_links); do ip link del "$link" 2>/dev/null || true; done
	rm -rf "$DIR"
	[[ -z $(our_netns) && -z $(our_links) ]] || die 1 "left behind: $(our_netns) $(our_links)"
	log "down"
}

cmd_status() {
	if [[ ! -e $DIR ]]; then
		echo down
		[[ -z $(our_netns)$(our_links) ]] || echo "left behind (run '$0 down'): $(our_netns) $(our_links)"
		return 0
	fi
	echo "export SLURM_CONF=$CONF"
	echo "slurmctld pids: $(our_daemon_pids slurmctld | xargs)"
	local name addr ns veth
	while read -r name addr ns veth; do
		echo "$name $addr netns=$ns veth=$veth($(cat "/sys/class/net/$veth/operstate" 2>/dev/null || echo gone))" \
			"pids: $(ip netns pids "$ns" 2>/dev/null | xargs)"
	done <"$DIR/nodes"
	sinfo -N || true
}

cmd_poweroff() {
	local want=${1:-} name ns veth _
	[[ -n $want ]] || die 2 "usage: $0 poweroff nodeI"
	while read -r name _ ns veth; do
		[[ $name == "$want" ]] || continue
		ip link set "$veth" down
		kill_netns_processes "$ns"
		log "$name powered off"
		return 0
	done <"$DIR/nodes"
	die 2 "no node $want in $DIR/nodes"
}

case ${1:-} in
up) cmd_up "${2:-}" "${3:-}" ;;
down) cmd_down ;;
status) cmd_status ;;
poweroff) cmd_poweroff "${2:-}" ;;
*) die 2 "usage: $0 up N [--quick] | down | status | poweroff nodeI" ;;
esac
