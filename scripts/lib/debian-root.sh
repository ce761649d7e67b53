# shellcheck shell=bash
# What scripts/check-fresh-machine and scripts/in-debian13 share: a cached
# minimal Debian root (mmdebstrap), its mounts, and their undoing. Sourced, not
# run; the caller has set `prog` (its name, for messages) and runs as root.
#
# Mirrors: $ATTNKIT_DEBIAN_MIRROR (default http://deb.debian.org/debian) and
# $ATTNKIT_DEBIAN_SECURITY (default http://deb.debian.org/debian-security).
# The cache: ${XDG_CACHE_HOME:-$HOME/.cache}/attnkit/.

debian_mirror="${ATTNKIT_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
debian_security="${ATTNKIT_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}"
debian_cache="${XDG_CACHE_HOME:-$HOME/.cache}/attnkit"

fmt_time() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# Re-runs the calling script in a private mount namespace, so that no mount it
# makes can propagate to the host or outlive it, whatever happens. Call it
# first, with the script's arguments.
# Inside a chroot (CI's Debian 13 leg runs in check-fresh-machine's Debian 12
# root) "/" is no mount point, and unshare cannot make it private ("cannot
# change root filesystem propagation"). There the namespace keeps the
# propagation it inherits: the enclosing script made its own namespace
# private already, and every mount these scripts make is made private itself.
debian_root_private_namespace() {
  if [ -z "${ATTNKIT_DEBIAN_ROOT_PRIVATE_NS:-}" ]; then
    local propagation=private
    unshare --mount --propagation private -- true 2>/dev/null || propagation=unchanged
    ATTNKIT_DEBIAN_ROOT_PRIVATE_NS=1 exec unshare --mount --propagation "$propagation" -- \
      bash "${BASH_SOURCE[1]}" "$@"
  fi
}

# debian_root_base SUITE REFRESH: prints the path of the cached minbase tarball
# of SUITE (bookworm, trixie) from its main, -updates and -security suites,
# keyed by mirror; builds it first when missing or when REFRESH is 1.
debian_root_base() {
  local suite="$1" refresh="$2" key base partial t0
  key="$(printf '%s %s' "$debian_mirror" "$debian_security" | sha256sum | cut -c1-12)"
  base="$debian_cache/$suite-minbase-$key.tar.gz"
  mkdir -p "$debian_cache"
  if [ "$refresh" = 1 ] || [ ! -s "$base" ]; then
    command -v mmdebstrap >/dev/null \
      || { echo "$prog: mmdebstrap is missing; install it with: apt-get install mmdebstrap" >&2; return 2; }
    echo "$prog: building the $suite base root ($debian_mirror, $debian_security) into $base" >&2
    t0=$SECONDS
    partial="$debian_cache/.partial-$suite-$$.tar.gz"
    if ! mmdebstrap --variant=minbase --mode=root "$suite" "$partial" \
        "deb $debian_mirror $suite main" \
        "deb $debian_mirror $suite-updates main" \
        "deb $debian_security $suite-security main" >&2; then
      rm -f "$partial"
      echo "$prog: mmdebstrap failed" >&2
      return 1
    fi
    mv -f "$partial" "$base"
    echo "$prog: base built in $(fmt_time $((SECONDS - t0))), $(du -h "$base" | cut -f1)" >&2
  fi
  echo "$base"
}

# The mount points under ROOT, deepest first.
debian_root_mounts() {
  awk -v r="$1" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r
}

# debian_root_mount ROOT: /proc, /sys, /dev and /dev/pts of the host, and its
# resolv.conf.
debian_root_mount() {
  local root="$1" d
  for d in proc sys dev dev/pts; do
    mkdir -p "$root/$d"
    mount --bind "/$d" "$root/$d"
    mount --make-private "$root/$d"
  done
  cp -L /etc/resolv.conf "$root/etc/resolv.conf"
}

# debian_root_umount ROOT: undoes every mount under ROOT; fails, naming them,
# when some stay.
debian_root_umount() {
  local root="$1" m
  for m in $(debian_root_mounts "$root"); do
    umount "$m" 2>/dev/null || umount --lazy "$m" || true
  done
  if [ -n "$(debian_root_mounts "$root")" ]; then
    echo "$prog: still mounted under $root:" >&2
    debian_root_mounts "$root" >&2
    return 1
  fi
}

# The environment commands get inside a root: nothing of the caller's but the
# settings that share the cores and choose the tests.
debian_root_env() {
  local v
  debian_env=(HOME=/root LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
  for v in ATTNKIT_JOBS ATTNKIT_TEST_JOBS ATTNKIT_TEST_CAPS ATTNKIT_TEST_EXCLUDE; do
    [ -n "${!v:-}" ] && debian_env+=("$v=${!v}")
  done
  return 0
}
