#!/usr/bin/env bash
# Proves deploy/images/runtime-packages.txt complete: installs only those
# packages into a minimal Debian 12 root (debootstrap --variant=minbase), puts
# the tandem binary in it, and runs a router with a prefill and a decode worker
# there (`tandem up` on the built-in model), as the image's non-root user would,
# then asks it for a chat completion. Needs root (chroot) and Debian's mirror.
# Usage: scripts/image_check.sh TANDEM_BIN [ROOT_DIR]   (ROOT_DIR is kept as a cache)
set -euo pipefail
bin=${1:?usage: image_check.sh TANDEM_BIN [ROOT_DIR]}
root=${2:-/var/tmp/tandem-image-root}
here=$(cd "$(dirname "$0")/.." && pwd)
(( $(id -u) == 0 )) || { echo "image_check: needs root (debootstrap, chroot)"; exit 77; }
command -v debootstrap >/dev/null || { echo "image_check: debootstrap is not installed"; exit 77; }
mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)}
mirror=${mirror:-http://deb.debian.org/debian}
pkgs=$(grep -v '^#' "$here/deploy/images/runtime-packages.txt" | paste -sd, -)
stamp="$root/.tandem-packages"
if [[ ! -f $stamp || $(cat "$stamp") != "$pkgs" ]]; then
  rm -rf "$root"
  debootstrap --variant=minbase --include="$pkgs" bookworm "$root" "$mirror" >"${root}.log" 2>&1 ||
    { tail -20 "${root}.log"; exit 1; }
  echo "$pkgs" >"$stamp"
fi
install -m 0755 "$bin" "$root/usr/local/bin/tandem"
chroot "$root" /bin/sh -c 'getent passwd tandem >/dev/null || { groupadd -g 10001 tandem && useradd -u 10001 -g 10001 -M -s /usr/sbin/nologin tandem; }'
rm -rf "$root/run/tandem"  # an earlier run's url must not be read as this one's
mkdir -p "$root/proc" "$root/run/tandem" && chown 10001:10001 "$root/run/tandem"
mkdir -p "$root/dev/shm"
mount -t proc proc "$root/proc"
mount -t tmpfs -o mode=1777 shm "$root/dev/shm"  # as a container has (UCX's shared-memory transport)
cleanup() {
  pkill -TERM -f "tandem up --port 0 --run-dir /run/tandem" 2>/dev/null || true
  sleep 1
  umount "$root/dev/shm" "$root/proc" 2>/dev/null || true
}
trap cleanup EXIT
# What the binary links against resolves inside the root alone:
if chroot "$root" ldd /usr/local/bin/tandem | grep 'not found'; then echo "image_check: missing libraries"; exit 1; fi
chroot --userspec=10001:10001 "$root" /usr/local/bin/tandem up --port 0 --run-dir /run/tandem \
  --ready-file /run/tandem/url --worker-threads 1 >"${root}.up.log" 2>&1 &
for _ in $(seq 600); do [[ -s $root/run/tandem/url ]] && break; sleep 0.1; done
[[ -s $root/run/tandem/url ]] || { echo "image_check: the cluster did not start"; tail -20 "${root}.up.log"; exit 1; }
trap 'rc=$?; (( rc == 0 )) || { echo "image_check: tandem up printed:"; tail -20 "${root}.up.log"; }; cleanup' EXIT
url=$(cat "$root/run/tandem/url")
model=$(sed -n 's/^  served_name: "\(.*\)"$/\1/p' "$root/run/tandem/router.yaml")
answer=$(curl -fsS --retry 5 --retry-connrefused "$url/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"max_tokens\": 8, \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}")
grep -q '"finish_reason"' <<<"$answer" || { echo "image_check: unexpected answer: $answer"; exit 1; }
echo "image_check: ok: a cluster in a Debian 12 root with only deploy/images/runtime-packages.txt answered: ${answer:0:160}"
