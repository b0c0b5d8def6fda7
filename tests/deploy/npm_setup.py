#!/usr/bin/env python3
"""Installs the locked npm packages of the manifest validator
(deploy/validate/package.json + package-lock.json) into a directory of the
build tree, ignored by git: BUILD_DIR/deploy-validate/node_modules.

  python3 tests/deploy/npm_setup.py BUILD_DIR

Offline-safe: when node_modules already holds the installation of this very
package-lock.json (a stamp file records its SHA-256), nothing is fetched.
Otherwise `npm ci --prefer-offline` installs exactly the locked versions
(from npm's cache when it has them). ctest runs this as the fixture
deploy_npm_setup before deploy_k8s_schema. Exit 0 when ready, 1 with what
to do otherwise. Needs Node.js >= 18 and npm (Debian: `apt-get install npm`,
or `make deps`).
"""

import hashlib
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "deploy", "validate")
FILES = ("package.json", "package-lock.json", "validate.mjs")


def main(argv):
    if len(argv) != 1:
        print("usage: npm_setup.py BUILD_DIR", file=sys.stderr)
        return 2
    dest = os.path.join(os.path.abspath(argv[0]), "deploy-validate")
    os.makedirs(dest, exist_ok=True)
    for name in FILES:
        shutil.copyfile(os.path.join(SOURCE, name), os.path.join(dest, name))
    with open(os.path.join(SOURCE, "package-lock.json"), "rb") as f:
        lock_sha = hashlib.sha256(f.read()).hexdigest()
    stamp = os.path.join(dest, "node_modules", ".gtopk-lock-sha256")
    try:
        with open(stamp) as f:
            if f.read().strip() == lock_sha:
                print("npm_setup: %s/node_modules matches package-lock.json "
                      "(%s...): nothing to install" % (dest, lock_sha[:12]))
                return 0
    except OSError:
        pass
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            print("npm_setup: `%s` not found: install Node.js >= 18 and npm "
                  "(Debian: apt-get install npm, or `make deps`)" % tool,
                  file=sys.stderr)
            return 1
    cmd = ["npm", "ci", "--prefer-offline", "--no-audit", "--no-fund",
           "--loglevel=error"]
    print("npm_setup: %s (in %s)" % (" ".join(cmd), dest))
    r = subprocess.run(cmd, cwd=dest, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        print("npm_setup: npm ci failed (exit %d): the npm registry (or npm's "
              "cache) must be reachable once to install the validator's "
              "packages" % r.returncode, file=sys.stderr)
        return 1
    with open(stamp, "w") as f:
        f.write(lock_sha + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
