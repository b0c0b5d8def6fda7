#!/usr/bin/env python3
"""Packs what the GPU machine lacks for building gtopk, and unpacks it there.

`make device-bundle` runs `device_bundle.py pack`: from this Debian 12
machine's installed packages, listed in deploy/device/device_bundle.txt (the one
list: see its header), it writes one folder (default build/device_bundle/):

  deps.tar.xz   a CMake prefix (include/, lib/x86_64-linux-gnu/ with the
                static .a libraries, shared ones where Debian has no .a,
                their CMake package and pkg-config files rewritten to be
                relocatable and, for static ones, to import the .a)
  proto/        gtopk/v1/gtopk.{pb,grpc.pb}.{h,cc} generated here by protoc
                3.21 + grpc_cpp_plugin 1.51 (the device has protoc 3.21.12
                but no plugin), and gtopk.proto.sha256 of the .proto they
                came from: CMake (-DGTOPK_DEVICE_BUNDLE=...) refuses stale ones
  data/         the `data` packages' files (Fashion-MNIST), if they fit
  MANIFEST.json package versions, sizes, the commit, what was left out

CMake unpacks deps.tar.xz itself (-DGTOPK_DEVICE_BUNDLE=<folder>, the
top-level CMakeLists.txt). `device_bundle.py system-paths BUNDLE` prints the
paths of this machine's packages that the bundle stands in for (MANIFEST.json
"replaces": headers, libraries of every variant, CMake and pkg-config files,
grpc_cpp_plugin), which deploy/device/bundle_check.sh hides to prove the bundle.

Exit status: 0 done; 1 a package missing or not installed, the bundle over
its limit; 2 bad usage.
"""

import argparse
import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIST = os.path.join(ROOT, "deploy", "device", "device_bundle.txt")
MULTIARCH = "lib/x86_64-linux-gnu"
MIB = 1024 * 1024


class BundleError(Exception):
    pass


def parse_list(path):
    """Returns [{package, kind, libs, when, replace}] from device_bundle.txt."""
    entries = []
    with open(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            words = line.split()
            if len(words) < 2 or words[1] not in ("static", "shared", "runtime", "data"):
                raise BundleError(f"{path}:{lineno}: expected '<package> static|shared|runtime|data [key=value...]'")
            e = {"package": words[0], "kind": words[1], "libs": [], "when": None, "replace": []}
            for kv in words[2:]:
                key, sep, value = kv.partition("=")
                if not sep:
                    raise BundleError(f"{path}:{lineno}: '{kv}' is not key=value")
                if key == "libs":
                    e["libs"] = [v for v in value.split(",") if v]
                elif key == "when":
                    e["when"] = value
                elif key == "replace":
                    old, sep2, new = value.partition(">>")
                    if not sep2:
                        raise BundleError(f"{path}:{lineno}: replace= needs OLD>>NEW")
                    e["replace"].append((old.replace("\\s", " "), new.replace("\\s", " ")))
                else:
                    raise BundleError(f"{path}:{lineno}: unknown key '{key}'")
            if e["kind"] in ("static", "shared", "runtime") and not e["libs"]:
                raise BundleError(f"{path}:{lineno}: {e['kind']} needs libs=")
            entries.append(e)
    return entries


def project_uses(name, root=ROOT):
    """Whether a CMakeLists.txt under `root` (the project) finds package `name`."""
    pat = re.compile(r"(find_package\(\s*" + re.escape(name) + r"[\s)]|pkg_check_modules\([^)]*\b"
                     + re.escape(name) + r"\b)", re.IGNORECASE)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("build", "node_modules")
                       and not d.startswith("build-")]
        if "CMakeLists.txt" in filenames:
            with open(os.path.join(dirpath, "CMakeLists.txt")) as f:
                if pat.search(f.read()):
                    return True
    return False


def package_files(package):
    """(version, [paths]) of an installed Debian package."""
    q = subprocess.run(["dpkg-query", "-W", "-f=${Status}\t${Version}", package],
                       capture_output=True, text=True)
    if q.returncode != 0 or "install ok installed" not in q.stdout:
        raise BundleError(f"package {package} is not installed (make deps, or apt-get install {package})")
    version = q.stdout.split("\t", 1)[1]
    listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True)
    return version, [p for p in listing.stdout.splitlines() if p.startswith("/")]


def lib_matches(basename, libs, suffix):
    """Whether lib<name><suffix...> names one of `libs` (globs allowed)."""
    for name in libs:
        if suffix == ".a" and fnmatch.fnmatch(basename, f"lib{name}.a"):
            return True
        if suffix == ".so" and (fnmatch.fnmatch(basename, f"lib{name}.so")
                                or fnmatch.fnmatch(basename, f"lib{name}.so.*")):
            # lib{name}.so.* must not also match lib{name}-cpp.so for name=civetweb.
            stem = basename.split(".so", 1)[0]
            if fnmatch.fnmatch(stem, f"lib{name}"):
                return True
    return False


def copy_into(src, prefix):
    """Copies /usr/<rel> to prefix/<rel>, keeping symlinks as symlinks."""
    rel = os.path.relpath(src, "/usr")
    dst = os.path.join(prefix, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.lexists(dst):
        return dst
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    else:
        shutil.copy2(src, dst)
    return dst


def shared_chain(path):
    """A .so path and every link on the way to the file (dev link, SONAME)."""
    chain = [path]
    while os.path.islink(chain[-1]):
        target = os.readlink(chain[-1])
        chain.append(os.path.normpath(os.path.join(os.path.dirname(chain[-1]), target)))
    return chain


LOCATION_RE = re.compile(r'set_target_properties\(([^ )]+) PROPERTIES\s+IMPORTED_LOCATION_\w+ '
                         r'"\$\{_IMPORT_PREFIX\}/' + MULTIARCH + r'/(lib[^"/]+?)\.so[0-9.]*"')


def static_targets(cmake_files, static_libs):
    """Imported targets (of a package's CMake files) whose .a is packed."""
    targets = set()
    for path in cmake_files:
        with open(path) as f:
            for target, base in LOCATION_RE.findall(f.read()):
                if base in static_libs:
                    targets.add(target)
    return targets


def rewrite_cmake(path, prefix, static_libs, targets, replace):
    """Makes a packed CMake package file import what the bundle has: the
    targets in `targets` become STATIC, located at their .a, without a
    SONAME (the configuration file names the location, the targets file
    declares the type)."""
    with open(path) as f:
        text = f.read()
    for old, new in replace:
        text = text.replace(old, new)
    def to_static(m):
        return f'{m.group(1)}{m.group(2)}.a"' if m.group(2) in static_libs else m.group(0)
    text = re.sub(r'("\$\{_IMPORT_PREFIX\}/' + MULTIARCH + r'/)(lib[^"/]+?)\.so[0-9.]*"', to_static, text)
    for target in targets:
        text = text.replace(f"add_library({target} SHARED IMPORTED)", f"add_library({target} STATIC IMPORTED)")
    text = re.sub(r'\n\s*IMPORTED_SONAME_\w+ "(lib[^"]+?)\.so[^"]*"',
                  lambda m: "" if m.group(1) in static_libs else m.group(0), text)
    # Files the import checks would demand but the bundle leaves out (other
    # variants of a library, the protoc plugins): the targets stay declared
    # and fail only if something links them.
    def keep_check(m):
        f = m.group(2).replace("${_IMPORT_PREFIX}", prefix)
        return m.group(0) if os.path.lexists(f) else ""
    text = re.sub(r'list\(APPEND (_IMPORT_CHECK_FILES_FOR_|_cmake_import_check_files_for_)\S+ "([^"]+)" \)\n',
                  keep_check, text)
    with open(path, "w") as f:
        f.write(text)


def rewrite_pc(path, drop_private):
    with open(path) as f:
        lines = f.read().splitlines()
    out = []
    for line in lines:
        # Debian writes /usr into prefix= and, in some files, into libdir=
        # and includedir= too (re2.pc, absl_*.pc): every one of them.
        line = re.sub(r"^(\w+)=/usr(?=/|$)", r"\1=${pcfiledir}/../../..", line)
        if drop_private and line.startswith("Requires.private:"):
            continue
        out.append(line)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def generate_proto(out_dir):
    """gtopk.proto -> out_dir/gtopk/v1/*.pb.{h,cc}, *.grpc.pb.{h,cc}."""
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_cpp_plugin")
    if not protoc or not plugin:
        raise BundleError("protoc or grpc_cpp_plugin not found (protobuf-compiler, protobuf-compiler-grpc)")
    src_dir = os.path.join(ROOT, "proto")
    proto = os.path.join(src_dir, "gtopk", "v1", "gtopk.proto")
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([protoc, f"--proto_path={src_dir}", f"--cpp_out={out_dir}", f"--grpc_out={out_dir}",
                    f"--plugin=protoc-gen-grpc={plugin}", proto], check=True)
    with open(proto, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(out_dir, "gtopk.proto.sha256"), "w") as f:
        f.write(digest + "\n")
    version = subprocess.run([protoc, "--version"], capture_output=True, text=True).stdout.strip()
    return {"protoc": version, "proto_sha256": digest}


def replaced_globs(taken, prefix):
    """/usr globs (relative) of the system files a package's packed files
    stand in for: top-level include entries, every file of each packed
    library (lib<name>.a, .so, .so.N), CMake package folders, .pc files."""
    out = set()
    for t in taken:
        rel = os.path.relpath(t, prefix)
        parts = rel.split(os.sep)
        if parts[0] == "include":
            out.add(os.path.join("include", parts[1]))
        elif rel.startswith(MULTIARCH + "/cmake/"):
            out.add(os.path.join(MULTIARCH, "cmake", parts[3]))
        elif rel.endswith(".pc"):
            out.add(rel)
        elif parts[-1].startswith("lib") and (rel.endswith(".a") or ".so" in parts[-1]):
            stem = parts[-1].split(".so", 1)[0]
            stem = stem[:-2] if stem.endswith(".a") else stem
            out.add(os.path.join(MULTIARCH, glob.escape(stem) + ".*"))
    return sorted(out)


def tree_bytes(path):
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def pack(args):
    t0 = time.time()
    entries = parse_list(args.list)
    forced = {w for w in os.environ.get("GTOPK_BUNDLE_WITH", "").split(",") if w}
    out = os.path.abspath(args.out)
    stage = out + ".tmp"
    shutil.rmtree(stage, ignore_errors=True)
    prefix = os.path.join(stage, "prefix")
    os.makedirs(prefix)
    manifest = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "commit": subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                         text=True).stdout.strip(),
                "list": os.path.relpath(args.list, ROOT), "limit_bytes": args.limit_mib * MIB,
                "packages": [], "left_out": [],
                # /usr globs the bundle stands in for (not the runtime kind:
                # system programs such as cmake load those libraries too).
                "replaces": ["bin/grpc_cpp_plugin"]}
    data_entries = []
    static_libs = set()  # lib<name> of every packed .a (one package's CMake files may import another's)
    packed_cmake = []  # ([CMake files], replace=) per package
    for e in entries:
        if e["when"] and e["when"] not in forced and not project_uses(e["when"]):
            manifest["left_out"].append({"package": e["package"],
                                         "why": f"the build does not use {e['when']} (GTOPK_BUNDLE_WITH={e['when']} forces it)"})
            continue
        version, files = package_files(e["package"])
        if e["kind"] == "data":
            data_entries.append((e, version, [f for f in files if f.startswith("/usr/share/datasets/")
                                              and os.path.isfile(f)]))
            continue
        taken = []
        cmake_files = []
        for f in files:
            base = os.path.basename(f)
            if os.path.isdir(f) and not os.path.islink(f):
                continue
            if e["kind"] in ("static", "shared") and f.startswith("/usr/include/"):
                taken.append(copy_into(f, prefix))
            elif e["kind"] == "static" and f.endswith(".a") and lib_matches(base, e["libs"], ".a"):
                taken.append(copy_into(f, prefix))
                static_libs.add(base[:-2])
            elif e["kind"] in ("shared", "runtime") and ".so" in base and lib_matches(base, e["libs"], ".so"):
                for link in shared_chain(f):
                    taken.append(copy_into(link, prefix))
            elif e["kind"] in ("static", "shared") and f"/{MULTIARCH}/cmake/" in f and f.endswith(".cmake"):
                cmake_files.append(copy_into(f, prefix))
                taken.append(cmake_files[-1])
            elif e["kind"] in ("static", "shared") and f.endswith(".pc"):
                taken.append(copy_into(f, prefix))
                rewrite_pc(taken[-1], drop_private=e["kind"] == "shared")
        if e["kind"] in ("static", "shared"):
            manifest["replaces"].extend(replaced_globs(taken, prefix))
        for name in e["libs"]:
            suffix = ".a" if e["kind"] == "static" else ".so"
            if not any(lib_matches(os.path.basename(t), [name], suffix) for t in taken):
                raise BundleError(f"{e['package']}: no lib{name}{suffix} in the package (device_bundle.txt libs=)")
        packed_cmake.append((cmake_files, e["replace"]))
        manifest["packages"].append({"package": e["package"], "version": version, "kind": e["kind"],
                                     "files": len(taken),
                                     "bytes": sum(os.path.getsize(t) for t in taken if not os.path.islink(t))})
    all_cmake = [c for files, _ in packed_cmake for c in files]
    targets = static_targets(all_cmake, static_libs)
    for files, replace in packed_cmake:
        for c in files:
            rewrite_cmake(c, prefix, static_libs, targets, replace)
    manifest["proto"] = generate_proto(os.path.join(stage, "proto"))
    raw = tree_bytes(prefix)
    tar_path = os.path.join(stage, "deps.tar.xz")
    with tarfile.open(tar_path, "w:xz", preset=9) as tar:
        tar.add(prefix, arcname="prefix")
    shutil.rmtree(prefix)
    manifest["deps"] = {"raw_bytes": raw, "xz_bytes": os.path.getsize(tar_path)}
    budget = args.limit_mib * MIB - tree_bytes(stage) - 64 * 1024  # room for MANIFEST.json
    for e, version, files in data_entries:
        need = sum(os.path.getsize(f) for f in files)
        if need > budget:
            manifest["left_out"].append({"package": e["package"], "why": f"{need / MIB:.1f} MiB would exceed the "
                                         f"{args.limit_mib} MiB limit ({budget / MIB:.1f} MiB left)"})
            continue
        for f in files:
            dst = os.path.join(stage, "data", os.path.relpath(f, "/usr/share/datasets"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(f, dst)
        budget -= need
        manifest["packages"].append({"package": e["package"], "version": version, "kind": "data",
                                     "files": len(files), "bytes": need})
    total = tree_bytes(stage)
    if total > args.limit_mib * MIB:
        raise BundleError(f"the bundle is {total / MIB:.1f} MiB, over its {args.limit_mib} MiB limit")
    manifest["total_bytes"] = total
    manifest["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(stage, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(stage, out)
    print(f"device-bundle: {out}: {total / MIB:.1f} MiB (libraries {raw / MIB:.1f} MiB raw, "
          f"{manifest['deps']['xz_bytes'] / MIB:.1f} MiB xz) in {manifest['seconds']} s")
    for p in manifest["packages"]:
        print(f"  {p['kind']:8} {p['package']} {p['version']}: {p['files']} files, {p['bytes'] / MIB:.1f} MiB")
    for p in manifest["left_out"]:
        print(f"  left out {p['package']}: {p['why']}")


def system_paths(args):
    """Prints the /usr paths (existing here) that the bundle stands in for:
    what deploy/device/bundle_check.sh hides so the build must use the bundle."""
    with open(os.path.join(args.bundle, "MANIFEST.json")) as f:
        manifest = json.load(f)
    found = set()
    for pattern in manifest["replaces"]:
        found.update(glob.glob(os.path.join("/usr", pattern)))
    for p in sorted(found):
        print(p)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack the bundle (make device-bundle)")
    p.add_argument("--out", default=os.path.join(ROOT, "build", "device_bundle"))
    p.add_argument("--list", default=LIST)
    p.add_argument("--limit-mib", type=int, default=40)
    u = sub.add_parser("system-paths", help="the /usr paths the bundle replaces")
    u.add_argument("bundle")
    args = ap.parse_args()
    try:
        (pack if args.cmd == "pack" else system_paths)(args)
    except (BundleError, subprocess.CalledProcessError, OSError) as e:
        print(f"device_bundle.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
