#!/usr/bin/env bash
# Build the control-plane binaries of the cluster test tier into tests/cluster/bin/:
#   kube-apiserver kube-controller-manager kube-scheduler kubectl   (module ./go.mod, Kubernetes v1.37.2)
#   etcd                                                            (module ./etcd/go.mod, etcd v3.6)
#   kwok                                                            (module ./kwok/go.mod, kwok v0.8.0)
#
# Built binaries are also kept outside the checkout, in
#   ${GPULAB_CLUSTER_BIN_CACHE:-${XDG_CACHE_HOME:-~/.cache}/gpulab/cluster-bin}/<key>/
# where <key> hashes the module files (go.mod, go.sum, the main packages) and the build recipe
# below; a fresh clone with the same key copies them from there in a second, without Go.
# Anything else is built with `go build` through Go's build and module caches: the first build on
# two cores takes tens of minutes (mostly kube-apiserver), a relink with a warm cache minutes.
#
# Usage: tests/cluster/build.sh [-f|--force] [-q|--quiet] [--print-key] [binary ...]   (no names: all six)
#   -f  rebuild (and re-cache) even when bin/ or the cache has the binaries
#   -q  print nothing when everything is up to date
#   --print-key  print the cache key (e.g. for a CI cache) and exit
# Exit codes: 0 built or up to date, 1 a build failed, 2 bad usage, 127 no Go toolchain.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$here/bin"
k8s_version="v1.37.2"

force=0
quiet=0
print_key=0
wanted=()
for arg in "$@"; do
    case "$arg" in
        -f|--force) force=1 ;;
        -q|--quiet) quiet=1 ;;
        --print-key) print_key=1 ;;
        -h|--help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "build.sh: unknown option $arg" >&2; exit 2 ;;
        *) wanted+=("$arg") ;;
    esac
done

# name, module directory (relative to $here), main package
targets=(
    "kube-apiserver          .     k8s.io/kubernetes/cmd/kube-apiserver"
    "kube-controller-manager .     k8s.io/kubernetes/cmd/kube-controller-manager"
    "kube-scheduler          .     k8s.io/kubernetes/cmd/kube-scheduler"
    "kubectl                 .     k8s.io/kubernetes/cmd/kubectl"
    "etcd                    etcd  gpulab.test/cluster/etcd"
    "kwok                    kwok  sigs.k8s.io/kwok/cmd/kwok"
)

if ((${#wanted[@]})); then
    for w in "${wanted[@]}"; do
        found=0
        for t in "${targets[@]}"; do [[ "${t%% *}" == "$w" ]] && found=1; done
        ((found)) || { echo "build.sh: unknown binary $w" >&2; exit 2; }
    done
fi

# Version stamps the Kubernetes binaries report (kubectl version, /version), as the
# upstream release build sets them; no build date, so links are reproducible.
vpkg="k8s.io/component-base/version"
cpkg="k8s.io/client-go/pkg/version"
k8s_ldflags="-s -w"
for p in "$vpkg" "$cpkg"; do
    k8s_ldflags+=" -X $p.gitVersion=$k8s_version -X $p.gitMajor=1 -X $p.gitMinor=37 -X $p.gitTreeState=clean"
done
other_ldflags="-s -w"
# Same flags on every run: the build cache is keyed on them. -trimpath keeps the
# checkout path out of the cache keys, so another clone reuses the cache too.
common=(-trimpath -buildvcs=false)

# The cache key: everything that decides what the binaries are. Change `recipe` (or the
# flags above) when changing how they are built; editing the rest of this script keeps the key.
recipe="1 CGO_ENABLED=0 ${common[*]} k8s=[$k8s_ldflags] other=[$other_ldflags] $(uname -s)-$(uname -m)"
inputs=(go.mod go.sum tools.go etcd/go.mod etcd/go.sum etcd/main.go kwok/go.mod kwok/go.sum kwok/tools.go)
key="$(
    cd "$here"
    printf '%s\n' "$recipe"
    for f in "${inputs[@]}"; do printf '\n--- %s\n' "$f"; cat "$f"; done
)"
key="$(printf '%s' "$key" | sha256sum | cut -c1-20)"
if ((print_key)); then echo "$key"; exit 0; fi

mkdir -p "$bin"
# One build at a time in this checkout (two pytest sessions may both find the binaries missing).
exec 9>"$bin/.build.lock"
command -v flock >/dev/null 2>&1 && flock 9

cache_root="${GPULAB_CLUSTER_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpulab/cluster-bin}"
cache="$cache_root/$key"
if mkdir -p "$cache" 2>/dev/null && [[ -w "$cache" ]]; then
    # ... and one build at a time across checkouts sharing the cache (two cold builds at
    # once would only halve each other's speed).
    exec 8>"$cache_root/.lock"
    command -v flock >/dev/null 2>&1 && flock 8
    touch "$cache"
else
    echo "build.sh: cannot write the binary cache $cache; building into $bin only" >&2
    cache=""
fi

say() { ((quiet)) || echo "build.sh: $*"; }

# Put file $1 at $2 (same inode where possible: neither is ever modified in place).
place() {
    local tmp="$2.tmp.$$"
    rm -f "$tmp"
    ln "$1" "$tmp" 2>/dev/null || cp -p "$1" "$tmp"
    mv -f "$tmp" "$2"
}

need_go() {
    if ! command -v go >/dev/null 2>&1; then
        echo "build.sh: no Go toolchain on PATH: install Go >= 1.26 (https://go.dev/dl/) to build the Kubernetes test binaries (cluster tests)" >&2
        exit 127
    fi
}

built=0
copied=0
skipped=0
start_all=$SECONDS
for t in "${targets[@]}"; do
    read -r name moddir pkg <<<"$t"
    if ((${#wanted[@]})); then
        keep=0
        for w in "${wanted[@]}"; do [[ "$w" == "$name" ]] && keep=1; done
        ((keep)) || continue
    fi
    out="$bin/$name"
    stamp="$bin/.$name.key"
    if ((!force)) && [[ -x "$out" && -f "$stamp" && "$(<"$stamp")" == "$key" ]]; then
        skipped=$((skipped + 1))
        continue
    fi
    if ((!force)) && [[ -n "$cache" && -x "$cache/$name" ]]; then
        place "$cache/$name" "$out"
        echo "$key" >"$stamp"
        say "$name from the cache $cache"
        copied=$((copied + 1))
        continue
    fi
    need_go
    if [[ "$moddir" == "." ]]; then ldflags="$k8s_ldflags"; else ldflags="$other_ldflags"; fi
    echo "build.sh: building $name ($pkg) ..."
    t0=$SECONDS
    tmp="$bin/.$name.tmp"
    rm -f "$tmp" "$stamp"
    if ! (cd "$here/$moddir" && CGO_ENABLED=0 go build "${common[@]}" -ldflags="$ldflags" -o "$tmp" "$pkg"); then
        rm -f "$tmp"
        echo "build.sh: building $name failed" >&2
        exit 1
    fi
    mv -f "$tmp" "$out"
    [[ -n "$cache" ]] && place "$out" "$cache/$name"
    echo "$key" >"$stamp"
    echo "build.sh: built $name in $((SECONDS - t0))s"
    built=$((built + 1))
done

# kwok's CRDs (Stage, ...) go next to the binary, for ControlPlane(kwok_enable_crds=[...]).
crds="$bin/kwok-crds"
if [[ -x "$bin/kwok" ]] && { ((force)) || [[ ! -f "$crds/.key" || "$(<"$crds/.key")" != "$key" ]]; }; then
    if ((!force)) && [[ -n "$cache" && -f "$cache/kwok-crds/.key" ]]; then
        src="$cache/kwok-crds"
    else
        need_go
        src="$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/crd/bases"
    fi
    rm -rf "$crds.tmp" && mkdir -p "$crds.tmp"
    cp "$src"/*.yaml "$crds.tmp/" && chmod -R u+w "$crds.tmp"
    echo "$key" >"$crds.tmp/.key"
    rm -rf "$crds" && mv "$crds.tmp" "$crds"
    if [[ -n "$cache" && "$src" != "$cache/kwok-crds" ]]; then
        rm -rf "$cache/kwok-crds.tmp.$$" && cp -r "$crds" "$cache/kwok-crds.tmp.$$"
        rm -rf "$cache/kwok-crds" && mv "$cache/kwok-crds.tmp.$$" "$cache/kwok-crds"
    fi
    say "kwok CRDs in $crds"
fi

# Binaries of other keys not used for 30 days go (about 400 MB each).
if [[ -n "$cache" ]]; then
    find "$cache_root" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -mtime +30 \
        -exec rm -rf {} + 2>/dev/null || true
fi

if ((built || copied || !quiet)); then
    echo "build.sh: $built built, $copied from the cache, $skipped up to date, $((SECONDS - start_all))s, in $bin (key $key)"
fi
