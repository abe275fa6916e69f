#!/bin/bash
# Stand-in base images for the TB2 tasks' FROM lines, made from Debian with debootstrap,
# packed with umoci and pushed to the loopback registry (start-registry.sh) with skopeo.
# Run as root. Rerunnable: a root filesystem whose recipe stamp matches is not rebuilt;
# every tag is packed and pushed again (cheap).
#
#   rootfs          recipe                                              pushed as (library/...)
#   trixie-python   trixie minbase + python3 (3.13) pip venv dev       python:3.13-slim-bookworm
#   bookworm-python bookworm minbase + python3 (3.11) pip venv dev     python:3.11-slim, python:3.11,
#                                                                      python:3.10-slim-bookworm (no Debian has 3.10)
#   trixie-min      trixie minbase                                     ubuntu:24.04, debian:13.0-slim,
#                                                                      debian:bullseye-slim
# Each gets the host's CA bundle (/etc/ssl/certs/ca-certificates.crt, and the extra CAs in
# /usr/local/share/ca-certificates, which update-ca-certificates keeps when an image
# installs ca-certificates later): outgoing HTTPS here is intercepted.
# Python ones: /usr/local/bin/{python,python3,pip,pip3} links, no EXTERNALLY-MANAGED marker.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${TB2_IMAGES_DIR:-$HERE/images}
REG=${TB2_REGISTRY_ADDR:-127.0.0.1:5055}
MIRROR=http://deb.debian.org/debian
LAYOUT=$WORK/oci
RECIPE_VERSION=v1
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
PYPKGS=python3,python3-pip,python3-venv,python3-dev
ENVPATH=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

[ "$(id -u)" = 0 ] || { echo "run as root (debootstrap)" >&2; exit 1; }
mkdir -p "$WORK"

rootfs() {  # NAME SUITE INCLUDE(or -) -> $WORK/rootfs/NAME
    local name=$1 suite=$2 include=$3
    local dest=$WORK/rootfs/$name stamp="$WORK/rootfs/$name.stamp"
    local key="$RECIPE_VERSION debootstrap --variant=minbase ${include:+--include=$include} $suite $MIRROR; ca; python-links"
    if [ -d "$dest" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then echo "== $name: up to date"; return; fi
    echo "== $name: debootstrap $suite ($include)"
    rm -rf --one-file-system "$dest" "$dest.tmp"; rm -f "$stamp"
    mkdir -p "$WORK/rootfs"
    local inc=(); [ "$include" != - ] && inc=(--include="$include")
    nice -n 10 debootstrap --variant=minbase "${inc[@]}" "$suite" "$dest.tmp" "$MIRROR" >"$WORK/rootfs/$name.log" 2>&1 \
        || { tail -30 "$WORK/rootfs/$name.log" >&2; exit 1; }
    local r=$dest.tmp
    # apt sources as Debian's images have them (all on deb.debian.org), no package lists
    rm -f "$r/etc/apt/sources.list"
    cat >"$r/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/*.bin "$r"/var/cache/apt/archives/*.deb
    # the host's CAs
    mkdir -p "$r/etc/ssl/certs" "$r/usr/local/share/ca-certificates"
    cp /etc/ssl/certs/ca-certificates.crt "$r/etc/ssl/certs/ca-certificates.crt"
    cp /usr/local/share/ca-certificates/*.crt "$r/usr/local/share/ca-certificates/" 2>/dev/null || true
    if [ "$include" != - ]; then
        rm -f "$r"/usr/lib/python3*/EXTERNALLY-MANAGED
        ln -sf /usr/bin/python3 "$r/usr/local/bin/python"
        ln -sf /usr/bin/python3 "$r/usr/local/bin/python3"
        ln -sf /usr/bin/pip3 "$r/usr/local/bin/pip"
        ln -sf /usr/bin/pip3 "$r/usr/local/bin/pip3"
    fi
    # what a container runtime provides, not the image
    find "$r/dev" -mindepth 1 -delete 2>/dev/null || true
    : >"$r/etc/resolv.conf" 2>/dev/null || true
    mv "$r" "$dest"
    echo "$key" >"$stamp"
}

pack() {  # NAME CMD... -> $LAYOUT:NAME (one layer)
    local name=$1; shift
    local bundle=$WORK/bundle-$name
    [ -f "$LAYOUT/index.json" ] || umoci init --layout "$LAYOUT"
    umoci rm --image "$LAYOUT:$name" 2>/dev/null || true
    umoci new --image "$LAYOUT:$name"
    rm -rf --one-file-system "$bundle"
    umoci unpack --image "$LAYOUT:$name" "$bundle" >/dev/null
    cp -a "$WORK/rootfs/$name/." "$bundle/rootfs/"
    umoci repack --image "$LAYOUT:$name" "$bundle"
    rm -rf --one-file-system "$bundle"
    local cmd=(); for c in "$@"; do cmd+=(--config.cmd "$c"); done
    umoci config --image "$LAYOUT:$name" --config.env "$ENVPATH" --config.env LANG=C.UTF-8 "${cmd[@]}"
    echo "== packed $LAYOUT:$name"
}

push() {  # NAME REF...
    local name=$1; shift
    for ref in "$@"; do
        skopeo --insecure-policy copy --dest-tls-verify=false "oci:$LAYOUT:$name" "docker://$REG/library/$ref" >/dev/null
        echo "== pushed $REG/library/$ref  <- $name"
    done
}

uv_image() {  # VERSION -> ghcr.io/astral-sh/uv:VERSION stand-in: /uv and /uvx from PyPI's uv wheel
    local v=$1; local dir=$WORK/uv/$v
    mkdir -p "$dir"
    ls "$dir"/uv-$v-*.whl >/dev/null 2>&1 || \
        python3 -m pip download --no-deps --only-binary=:all: -d "$dir" "uv==$v" >/dev/null
    rm -rf "$dir/x"; mkdir -p "$dir/x"
    python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$(ls "$dir"/uv-$v-*.whl)" "$dir/x"
    [ -f "$LAYOUT/index.json" ] || umoci init --layout "$LAYOUT"
    umoci rm --image "$LAYOUT:uv-$v" 2>/dev/null || true
    umoci new --image "$LAYOUT:uv-$v"
    local bundle=$WORK/bundle-uv-$v
    rm -rf "$bundle"; umoci unpack --image "$LAYOUT:uv-$v" "$bundle" >/dev/null
    install -m 0755 "$dir"/x/uv-$v.data/scripts/uv "$bundle/rootfs/uv"
    install -m 0755 "$dir"/x/uv-$v.data/scripts/uvx "$bundle/rootfs/uvx"
    umoci repack --image "$LAYOUT:uv-$v" "$bundle"; rm -rf "$bundle" "$dir/x"
    umoci config --image "$LAYOUT:uv-$v" --config.entrypoint /uv
    "$HERE/start-registry.sh" >/dev/null
    skopeo --insecure-policy copy --dest-tls-verify=false "oci:$LAYOUT:uv-$v" "docker://$REG/astral-sh/uv:$v" >/dev/null
    echo "== pushed $REG/astral-sh/uv:$v (stand-in for ghcr.io/astral-sh/uv:$v, from PyPI's uv wheel)"
}

# Stand-ins for COPY --from=ghcr.io/astral-sh/uv:X (financial-document-processor, reshard-c4-data);
# config.toml mirrors ghcr.io to the loopback registry too.
if [ "${1:-all}" = uv ]; then uv_image 0.8.14; uv_image 0.8.15; exit 0; fi

rootfs trixie-python trixie "$PYPKGS"
rootfs bookworm-python bookworm "$PYPKGS"
rootfs trixie-min trixie -
umoci gc --layout "$LAYOUT" 2>/dev/null || true
pack trixie-python python3
pack bookworm-python python3
pack trixie-min /bin/bash
umoci gc --layout "$LAYOUT"
"$HERE/start-registry.sh"
push trixie-python python:3.13-slim-bookworm
push bookworm-python python:3.11-slim python:3.11 python:3.10-slim-bookworm
push trixie-min ubuntu:24.04 debian:13.0-slim debian:bullseye-slim
uv_image 0.8.14
uv_image 0.8.15
echo "== done; tags:"; curl -fsS "http://$REG/v2/_catalog"; echo
