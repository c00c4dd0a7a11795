#!/usr/bin/env bash
# Build the control-plane binaries of the cluster test tier into tests/cluster/bin/:
#   kube-apiserver kube-controller-manager kube-scheduler kubectl   (module ./go.mod, Kubernetes v1.37.2)
#   etcd                                                            (module ./etcd/go.mod, etcd v3.6)
#   kwok                                                            (module ./kwok/go.mod, kwok v0.8.0)
# and, for ControlPlane(queueing=True), the queueing controllers:
#   kueue                                                           (module ./kueue/go.mod, Kueue v0.17.0)
#   jobset                                                          (module ./jobset/go.mod, JobSet v0.11.1)
# with the manifests they ship (CRDs, webhook configurations, RBAC: their module's
# config/components/{crd,webhook,rbac}) copied into bin/kueue-manifests and bin/jobset-manifests;
# and, for the real node (node.py), its components:
#   kubelet kube-proxy                                              (module ./node/go.mod, Kubernetes v1.37.2)
#   containerd containerd-shim-runc-v2 ctr                          (module ./containerd/go.mod, containerd v2.4.2)
#   coredns                                                         (module ./dns/go.mod, CoreDNS v1.15.0)
#   kube-router (its NetworkPolicy firewall only)                   (module ./kuberouter/go.mod, kube-router v2.1.0)
# (runc, the CNI plugins and ipset are Debian's packages, which work here).
# Kueue and JobSet need different controller-runtime versions, hence a module each. A cold build
# of the two on two cores: about 9 minutes after the control plane's (Kueue 5.2, JobSet 3.6),
# 11.7 with an empty Go build cache (Kueue 7.9, JobSet 3.7); downloads not counted.
#
# Built binaries are also kept outside the checkout, in
#   ${GPULAB_CLUSTER_BIN_CACHE:-${XDG_CACHE_HOME:-~/.cache}/gpulab/cluster-bin}/<key>/
# where <key> hashes the module files (go.mod, go.sum, the main packages) and the build recipe
# below; a fresh clone with the same key copies them from there in a second, without Go.
# There are four keys, one per group of binaries: the control plane (the first six, and kwok's
# CRDs), the queueing controllers (kueue, jobset and their manifests), the node's, and the
# node's NetworkPolicy firewall, so that adding or bumping one group never invalidates another's
# cache.
# Anything else is built with `go build` through Go's build and module caches: the first build on
# two cores takes tens of minutes (mostly kube-apiserver), a relink with a warm cache minutes.
#
# Usage: tests/cluster/build.sh [-f|--force] [-q|--quiet] [--print-key] [binary ...]   (no names: all)
#   -f  rebuild (and re-cache) even when bin/ or the cache has the binaries
#   -q  print nothing when everything is up to date
#   --print-key  print the cache keys (e.g. for a CI cache), one line per group, and exit
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
        -h|--help) sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "build.sh: unknown option $arg" >&2; exit 2 ;;
        *) wanted+=("$arg") ;;
    esac
done

# name, module directory (relative to $here), main package, cache key group
targets=(
    "kube-apiserver          .       k8s.io/kubernetes/cmd/kube-apiserver           k8s"
    "kube-controller-manager .       k8s.io/kubernetes/cmd/kube-controller-manager  k8s"
    "kube-scheduler          .       k8s.io/kubernetes/cmd/kube-scheduler           k8s"
    "kubectl                 .       k8s.io/kubernetes/cmd/kubectl                  k8s"
    "etcd                    etcd    gpulab.test/cluster/etcd                       k8s"
    "kwok                    kwok    sigs.k8s.io/kwok/cmd/kwok                      k8s"
    "kueue                   kueue   sigs.k8s.io/kueue/cmd/kueue                    queueing"
    "jobset                  jobset  sigs.k8s.io/jobset                             queueing"
    "kubelet                 node    k8s.io/kubernetes/cmd/kubelet                  node"
    "kube-proxy              node    k8s.io/kubernetes/cmd/kube-proxy               node"
    "containerd              containerd github.com/containerd/containerd/v2/cmd/containerd node"
    "containerd-shim-runc-v2 containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 node"
    "ctr                     containerd github.com/containerd/containerd/v2/cmd/ctr node"
    "coredns                 dns     gpulab.test/cluster/dns                        node"
    "kube-router             kuberouter github.com/cloudnativelabs/kube-router/v2/cmd/kube-router netpol"
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

# The cache keys: everything that decides what the binaries are. Change `recipe` (or the
# flags above) when changing how they are built; editing the rest of this script keeps the keys.
# The control-plane group's key is computed exactly as before the queueing group existed.
recipe="1 CGO_ENABLED=0 ${common[*]} k8s=[$k8s_ldflags] other=[$other_ldflags] $(uname -s)-$(uname -m)"
inputs_k8s=(go.mod go.sum tools.go etcd/go.mod etcd/go.sum etcd/main.go kwok/go.mod kwok/go.sum kwok/tools.go)
# the queueing group's recipe also names the manifest folders copied from the modules
recipe_queueing="$recipe manifests=[config/components/crd config/components/webhook config/components/rbac]"
inputs_queueing=(kueue/go.mod kueue/go.sum kueue/tools.go jobset/go.mod jobset/go.sum jobset/tools.go)
inputs_node=(node/go.mod node/go.sum node/tools.go containerd/go.mod containerd/go.sum containerd/tools.go
             dns/go.mod dns/go.sum dns/main.go)
inputs_netpol=(kuberouter/go.mod kuberouter/go.sum kuberouter/tools.go)
hash_inputs() {  # recipe, files...
    local r="$1" text
    shift
    text="$(
        cd "$here"
        printf '%s\n' "$r"
        for f in "$@"; do printf '\n--- %s\n' "$f"; cat "$f"; done
    )"
    printf '%s' "$text" | sha256sum | cut -c1-20
}
declare -A keys
keys[k8s]="$(hash_inputs "$recipe" "${inputs_k8s[@]}")"
keys[queueing]="$(hash_inputs "$recipe_queueing" "${inputs_queueing[@]}")"
keys[node]="$(hash_inputs "$recipe" "${inputs_node[@]}")"
keys[netpol]="$(hash_inputs "$recipe" "${inputs_netpol[@]}")"
if ((print_key)); then
    echo "k8s ${keys[k8s]}"
    echo "queueing ${keys[queueing]}"
    echo "node ${keys[node]}"
    echo "netpol ${keys[netpol]}"
    exit 0
fi

mkdir -p "$bin"
# One build at a time in this checkout (two pytest sessions may both find the binaries missing).
exec 9>"$bin/.build.lock"
command -v flock >/dev/null 2>&1 && flock 9

cache_root="${GPULAB_CLUSTER_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpulab/cluster-bin}"
declare -A caches
if mkdir -p "$cache_root/${keys[k8s]}" "$cache_root/${keys[queueing]}" "$cache_root/${keys[node]}" \
            "$cache_root/${keys[netpol]}" 2>/dev/null \
        && [[ -w "$cache_root/${keys[k8s]}" && -w "$cache_root/${keys[queueing]}" && -w "$cache_root/${keys[node]}" \
              && -w "$cache_root/${keys[netpol]}" ]]; then
    # ... and one build at a time across checkouts sharing the cache (two cold builds at
    # once would only halve each other's speed).
    exec 8>"$cache_root/.lock"
    command -v flock >/dev/null 2>&1 && flock 8
    for g in "${!keys[@]}"; do
        caches[$g]="$cache_root/${keys[$g]}"
        touch "${caches[$g]}"
    done
else
    echo "build.sh: cannot write the binary cache in $cache_root; building into $bin only" >&2
    caches[k8s]=""
    caches[queueing]=""
    caches[node]=""
    caches[netpol]=""
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
    read -r name moddir pkg group <<<"$t"
    key="${keys[$group]}"
    cache="${caches[$group]}"
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
    if [[ "$moddir" == "." || "$moddir" == "node" ]]; then ldflags="$k8s_ldflags"; else ldflags="$other_ldflags"; fi
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

# Manifests that go next to a binary, from its Go module's folder:
#   bin/kwok-crds         kwok's CRDs (Stage, ...), for ControlPlane(kwok_enable_crds=[...])
#   bin/kueue-manifests   Kueue's config/components/{crd,webhook,rbac}, for ControlPlane(queueing=True)
#   bin/jobset-manifests  JobSet's config/components/{crd,webhook,rbac}, likewise
# copy_manifests NAME BINARY GROUP MODDIR MODULE SUBDIR...: each SUBDIR of the module (a folder,
# copied whole) lands under bin/NAME/SUBDIR; a lone SUBDIR ending in /*.yaml copies just those files.
copy_manifests() {
    local name="$1" binary="$2" group="$3" moddir="$4" module="$5"
    shift 5
    local dest="$bin/$name" key="${keys[$group]}" cache="${caches[$group]}" src modroot sub
    [[ -x "$bin/$binary" ]] || return 0
    if ((!force)) && [[ -f "$dest/.key" && "$(<"$dest/.key")" == "$key" ]]; then
        return 0
    fi
    local from_cache=0
    rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
    if ((!force)) && [[ -n "$cache" && -f "$cache/$name/.key" ]]; then
        cp -r "$cache/$name/." "$dest.tmp/"
        from_cache=1
    else
        need_go
        modroot="$(cd "$here/$moddir" && go mod download "$module" && go list -m -f '{{.Dir}}' "$module")"
        for sub in "$@"; do
            if [[ "$sub" == *"/*.yaml" ]]; then
                cp "$modroot"/$sub "$dest.tmp/"
            else
                mkdir -p "$dest.tmp/$(dirname "$sub")"
                cp -r "$modroot/$sub" "$dest.tmp/$sub"
            fi
        done
    fi
    chmod -R u+w "$dest.tmp"
    echo "$key" >"$dest.tmp/.key"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
    if [[ -n "$cache" ]] && ((!from_cache)); then
        rm -rf "$cache/$name.tmp.$$" && cp -r "$dest" "$cache/$name.tmp.$$"
        rm -rf "$cache/$name" && mv "$cache/$name.tmp.$$" "$cache/$name"
    fi
    say "$name in $dest"
}
copy_manifests kwok-crds kwok k8s kwok sigs.k8s.io/kwok "kustomize/crd/bases/*.yaml"
copy_manifests kueue-manifests kueue queueing kueue sigs.k8s.io/kueue \
    config/components/crd config/components/webhook config/components/rbac
copy_manifests jobset-manifests jobset queueing jobset sigs.k8s.io/jobset \
    config/components/crd config/components/webhook config/components/rbac

# Binaries of other keys not used for 30 days go (about 400 MB each).
if [[ -n "${caches[k8s]}" ]]; then
    find "$cache_root" -mindepth 1 -maxdepth 1 -type d ! -name "${keys[k8s]}" ! -name "${keys[queueing]}" \
        ! -name "${keys[node]}" ! -name "${keys[netpol]}" ! -name images \
        -mtime +30 -exec rm -rf {} + 2>/dev/null || true
fi

if ((built || copied || !quiet)); then
    echo "build.sh: $built built, $copied from the cache, $skipped up to date, $((SECONDS - start_all))s, in $bin (keys ${keys[k8s]}, ${keys[queueing]}, ${keys[node]}, ${keys[netpol]})"
fi
