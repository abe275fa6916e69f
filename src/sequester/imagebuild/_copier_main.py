"""The program that carries out a COPY or ADD inside the step's sandbox (standard library only).

It runs under the verifier runner's Python (``-I -S``) with the step's root being the
overlay that becomes the new layer, so every path it writes, and every link on the way
to one, is resolved by the kernel inside the image: nothing it is asked to do can land
on the host. Its sources are read-only mounts below ``/dev/.sequester`` (the build
context, or the merged layers of another stage or image). Docker's rules:

* a folder source copies its *contents* into the destination;
* a file goes *into* the destination when that ends with ``/``, when there are several
  sources, or when it is an existing folder; otherwise it *becomes* the destination;
* missing parent folders are made (0755); modes and modification times are kept,
  ``--chmod`` replaces the mode of everything copied; links are copied as links;
* ``ADD`` of a local tar archive (plain, gzip, bzip2, xz) extracts it into the
  destination; ``ADD`` of a URL downloads it (through the build's proxy) to a 0600 file,
  trusting the certificates the host trusts (the runner's copy of its CA bundle).

Usage: ``python -I -S _copier_main.py PLAN.json``; exit status 0, or 1 with the reason
on stderr (the builder shows it with the Dockerfile's line).
"""

import hashlib
import json
import os
import posixpath
import ssl
import stat
import sys
import tarfile
import urllib.parse
import urllib.request

_CHUNK = 1 << 20
_LINK_HOPS = 40


class CopyFailed(Exception):
    pass


def _inside(root, path):
    """``path`` (absolute in the source) with its links resolved within ``root``."""
    parts, hops, done = [p for p in path.split("/") if p], 0, ""
    while parts:
        part = parts.pop(0)
        if part == "..":
            done = posixpath.dirname(done)
            continue
        if part == ".":
            continue
        candidate = done + "/" + part
        full = root + candidate
        if os.path.islink(full):
            hops += 1
            if hops > _LINK_HOPS:
                raise CopyFailed(f"{path}: too many levels of links")
            target = os.readlink(full)
            if target.startswith("/"):
                done = ""
            parts = [p for p in target.split("/") if p] + parts
            continue
        done = candidate
    return root + done if done else root


def _mode(st, chmod):
    return chmod if chmod is not None else stat.S_IMODE(st.st_mode)


def _clear(target, is_dir_source):
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        if is_dir_source:
            return True
        raise CopyFailed(f"cannot copy a file over the folder {target}")
    os.unlink(target)
    return False


def _copy_entry(src, target, chmod):
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        _clear(target, False)
        os.symlink(os.readlink(src), target)
    elif stat.S_ISDIR(st.st_mode):
        if not _clear(target, True):
            os.mkdir(target, 0o700)
        os.chmod(target, _mode(st, chmod))
    elif stat.S_ISREG(st.st_mode):
        _clear(target, False)
        with open(src, "rb") as fin:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as fout:
                while chunk := fin.read(_CHUNK):
                    fout.write(chunk)
        os.chmod(target, _mode(st, chmod))
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    elif stat.S_ISFIFO(st.st_mode):
        _clear(target, False)
        os.mkfifo(target, _mode(st, chmod))
    else:  # devices and sockets cannot be made in the build's namespace; Docker's copy skips sockets
        print(f"warning: {src} is a device or socket: not copied", file=sys.stderr)


def _copy_tree(src, target, chmod):
    _copy_entry(src, target, chmod)
    stack = [(src, target)]
    while stack:
        folder, dest = stack.pop()
        for name in sorted(os.listdir(folder)):
            s, d = os.path.join(folder, name), os.path.join(dest, name)
            _copy_entry(s, d, chmod)
            if stat.S_ISDIR(os.lstat(s).st_mode):
                stack.append((s, d))
    st = os.lstat(src)
    if chmod is None:
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))


def _parent(path):
    os.makedirs(posixpath.dirname(path) or "/", 0o755, exist_ok=True)


def copy(op):
    root, dest, chmod = op["root"], op["dest"], op.get("chmod")
    sources = [_inside(root, s) for s in op["sources"]]
    into = op["dest_is_dir"] or len(sources) > 1
    for src in sources:
        if not os.path.lexists(src):
            raise CopyFailed(f"{src[len(root) :] or '/'}: no such file or folder in the source")
        st = os.lstat(src)
        if stat.S_ISDIR(st.st_mode):
            _parent(dest.rstrip("/") + "/x")
            _copy_tree(src, dest, chmod)
            continue
        target = dest
        if into or os.path.isdir(dest):
            target = posixpath.join(dest, posixpath.basename(src))
        _parent(target)
        _copy_entry(src, target, chmod)


def extract(op):
    dest = op["dest"]
    os.makedirs(dest, 0o755, exist_ok=True)
    with tarfile.open(op["source"], "r:*") as archive:
        # Inside the step's sandbox a member cannot land outside the image whatever it
        # says; the "tar" filter (Python >= 3.11.4) still refuses ../ and absolute names.
        archive.extractall(dest, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))


def fetch(op):
    url, dest = op["url"], op["dest"]
    if op["dest_is_dir"]:
        name = posixpath.basename(urllib.parse.urlparse(url).path) or "index.html"
        dest = posixpath.join(dest, name)
    _parent(dest)
    digest = hashlib.sha256()
    tmp = dest + ".sequester-download"
    context = ssl.create_default_context(cafile=op["cafile"]) if op.get("cafile") else None
    with urllib.request.urlopen(url, timeout=60, context=context) as response:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    want = op.get("checksum")
    if want and "sha256:" + digest.hexdigest() != want:
        os.unlink(tmp)
        raise CopyFailed(f"{url}: checksum sha256:{digest.hexdigest()} is not the {want} asked for")
    os.chmod(tmp, op["chmod"] if op.get("chmod") is not None else 0o600)
    os.replace(tmp, dest)


def mkdir(op):
    os.makedirs(op["path"], 0o755, exist_ok=True)


def main(argv):
    with open(argv[1]) as f:
        plan = json.load(f)
    try:
        for op in plan["ops"]:
            {"copy": copy, "extract": extract, "fetch": fetch, "mkdir": mkdir}[op["kind"]](op)
    except (CopyFailed, OSError, tarfile.TarError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
