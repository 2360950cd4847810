#!/usr/bin/env python3
"""Runs the workspace's test binaries in concurrent lanes (tests/run.sh).

Input: the JSON messages of `cargo test --workspace --no-run
--message-format=json` (every test executable with its package). Each binary
runs as `cargo test` would run it: from its package's directory, with the
environment cargo sets (CARGO, CARGO_MANIFEST_DIR, CARGO_PKG_*, ...) and
`--test-threads`. The binaries named with --first start first, in that order
(the known-long ones, longest first), then the others in cargo's order, then
the doctests (`cargo test --workspace --doc`). With --tail-lanes N (more
than --lanes), N - lanes more lanes open once the --tail-after binary has
started (default: once every --first one has): the rest are short binaries
bound by start-up latency (a control plane, a namespace, a process) rather
than by the cores, which two lanes left half idle. Each binary writes its own log;
a log is printed whole when its binary ends, never interleaved with another.
At the end: every binary's time, then every failed test and binary with the
command that reruns it and the path of its log. Exit status 1 if anything
failed.
"""

import argparse
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time


def cargo_path(root):
    """The cargo binary cargo test would name in CARGO (the toolchain's)."""
    if shutil.which("rustup"):
        out = subprocess.run(["rustup", "which", "cargo"], cwd=root,
                             capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return shutil.which("cargo") or "cargo"


def sysroot_lib(root):
    out = subprocess.run(["rustc", "--print", "sysroot"], cwd=root,
                         capture_output=True, text=True, check=False)
    return os.path.join(out.stdout.strip(), "lib") if out.returncode == 0 else None


class Job:
    def __init__(self, name, argv, cwd, env, rerun, log, target=None):
        self.name = name          # e.g. "anneal-tests --test e2e_deploy"
        self.target = target      # an integration test's name, for --first
        self.argv = argv
        self.cwd = cwd
        self.env = env
        self.rerun = rerun        # the command a developer reruns it with
        self.log = log
        self.rc = None
        self.seconds = 0.0
        self.lane = None
        self.opens_tail = False   # its start opens the tail lanes


def package_env(pkg, target_name, cargo, extra_ld):
    version = pkg["version"]
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z.-]+))?", version)
    major, minor, patch, pre = m.groups() if m else ("", "", "", "")
    env = {
        "CARGO": cargo,
        "CARGO_MANIFEST_DIR": os.path.dirname(pkg["manifest_path"]),
        "CARGO_MANIFEST_PATH": pkg["manifest_path"],
        "CARGO_PKG_NAME": pkg["name"],
        "CARGO_PKG_VERSION": version,
        "CARGO_PKG_VERSION_MAJOR": major,
        "CARGO_PKG_VERSION_MINOR": minor,
        "CARGO_PKG_VERSION_PATCH": patch,
        "CARGO_PKG_VERSION_PRE": pre or "",
        "CARGO_PKG_AUTHORS": ":".join(pkg.get("authors") or []),
        "CARGO_PKG_DESCRIPTION": pkg.get("description") or "",
        "CARGO_PKG_HOMEPAGE": pkg.get("homepage") or "",
        "CARGO_PKG_REPOSITORY": pkg.get("repository") or "",
        "CARGO_PKG_LICENSE": pkg.get("license") or "",
        "CARGO_PKG_LICENSE_FILE": pkg.get("license_file") or "",
        "CARGO_PKG_RUST_VERSION": pkg.get("rust_version") or "",
        "CARGO_PKG_README": pkg.get("readme") or "",
        "CARGO_CRATE_NAME": target_name.replace("-", "_"),
    }
    ld = [p for p in extra_ld if p]
    if os.environ.get("LD_LIBRARY_PATH"):
        ld.append(os.environ["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(ld)
    return env


def collect(args, root):
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--no-deps", "--format-version", "1", "--locked"],
        cwd=root, capture_output=True, text=True, check=True).stdout)
    packages = {p["id"]: p for p in meta["packages"]}
    cargo = cargo_path(root)
    sysroot = sysroot_lib(root)
    jobs, seen = [], set()
    with open(args.messages, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
                continue
            if not msg.get("profile", {}).get("test"):
                continue
            exe = msg["executable"]
            if exe in seen:
                continue
            seen.add(exe)
            pkg = packages[msg["package_id"]]
            target = msg["target"]
            kind = target["kind"][0]
            if kind == "test":
                sel = f"--test {target['name']}"
            elif kind == "bin":
                sel = f"--bin {target['name']}"
            elif kind in ("example", "bench"):
                sel = f"--{kind} {target['name']}"
            else:
                sel = "--lib"
            name = f"{pkg['name']} {sel}"
            deps = os.path.dirname(exe)
            env = dict(os.environ)
            env.update(package_env(pkg, target["name"], cargo,
                                   [deps, os.path.dirname(deps), sysroot]))
            log = os.path.join(args.log_dir,
                               re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".log")
            jobs.append(Job(name,
                            [exe, f"--test-threads={args.test_threads}"],
                            os.path.dirname(pkg["manifest_path"]), env,
                            f"cargo test -p {pkg['name']} {sel}", log,
                            target["name"] if kind == "test" else None))
    return jobs


def order(jobs, first):
    by_target = {j.target: j for j in jobs if j.target}
    head = []
    for name in first:
        if name in by_target:
            head.append(by_target.pop(name))
        else:
            print(f"lanes: --first {name}: no such test binary in this build "
                  "(update the list in tests/run.sh)", flush=True)
    return head + [j for j in jobs if j not in head]


def run_job(job):
    start = time.monotonic()
    with open(job.log, "wb") as out:
        try:
            p = subprocess.Popen(job.argv, cwd=job.cwd, env=job.env,
                                 stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT)
            job.rc = p.wait()
        except OSError as e:
            out.write(f"lanes: cannot start {job.argv[0]}: {e}\n".encode())
            job.rc = 127
    job.seconds = time.monotonic() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", required=True,
                    help="cargo test --no-run --message-format=json output")
    ap.add_argument("--root", required=True, help="the workspace root")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--tail-lanes", type=int, default=0,
                    help="lanes once the --tail-after binary has started "
                         "(default: --lanes)")
    ap.add_argument("--tail-after", default=None,
                    help="the test target whose start opens the tail lanes "
                         "(default: the first binary not named by --first)")
    ap.add_argument("--test-threads", type=int, default=4)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--first", action="append", default=[],
                    help="a test target to start first (repeat; in order)")
    ap.add_argument("--only", action="append", default=[],
                    help="run only this test target (repeat); implies --no-doc")
    ap.add_argument("--no-doc", action="store_true", help="skip the doctests")
    args = ap.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    root = os.path.abspath(args.root)

    jobs = order(collect(args, root), args.first)
    if args.only:
        missing = set(args.only) - {j.target for j in jobs}
        if missing:
            print(f"lanes: --only {' '.join(sorted(missing))}: no such test binary", flush=True)
            return 2
        jobs = [j for j in jobs if j.target in args.only]
    if not args.no_doc and not args.only:
        doc = Job("doctests", ["cargo", "test", "--workspace", "--doc", "--locked",
                               "--", f"--test-threads={args.test_threads}"],
                  root, dict(os.environ), "cargo test --workspace --doc",
                  os.path.join(args.log_dir, "doctests.log"))
        jobs.append(doc)

    todo = queue.Queue()
    for j in jobs:
        todo.put(j)
    done = queue.Queue()
    started = time.monotonic()

    # the tail opens when a lane starts the --tail-after binary (else the
    # first one not named by --first)
    tail = threading.Event()
    after = args.tail_after
    if after is None:
        after = next((j.target for j in jobs if j.target not in args.first), None)
    mark = next((j for j in jobs if j.target == after), None)
    if mark is None:
        if args.tail_after:
            print(f"lanes: --tail-after {args.tail_after}: no such test binary", flush=True)
        tail.set()
    else:
        mark.opens_tail = True

    def lane(n):
        if n > args.lanes:
            tail.wait()
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                tail.set()  # nothing left: let the tail lanes end
                return
            if job.opens_tail:
                tail.set()
            job.lane = n
            done.put(("start", job))
            run_job(job)
            done.put(("end", job))

    args.lanes = max(1, args.lanes)
    n_lanes = max(args.lanes, args.tail_lanes)
    threads = [threading.Thread(target=lane, args=(n,), daemon=True)
               for n in range(1, n_lanes + 1)]
    tail_note = (f" ({n_lanes} once {after} has started)"
                 if n_lanes > args.lanes else "")
    print(f"lanes: {len(jobs)} test binaries in {args.lanes} lanes{tail_note}, "
          f"--test-threads={args.test_threads}, logs in {args.log_dir}", flush=True)
    for t in threads:
        t.start()
    ended = 0
    while ended < len(jobs):
        what, job = done.get()
        elapsed = time.monotonic() - started
        if what == "start":
            print(f"---- [{elapsed:6.0f}s] lane {job.lane} starts {job.name}", flush=True)
            continue
        ended += 1
        status = "ok" if job.rc == 0 else (
            f"FAILED (killed by signal {-job.rc})" if job.rc < 0 else f"FAILED (exit {job.rc})")
        print(f"\n==== [{elapsed:6.0f}s] {job.name}: {status} in {job.seconds:.1f}s "
              f"(lane {job.lane}, {ended}/{len(jobs)}; log {job.log})", flush=True)
        with open(job.log, "rb") as f:
            text = f.read()
        sys.stdout.buffer.write(text)
        if text and not text.endswith(b"\n"):
            sys.stdout.buffer.write(b"\n")
        print(f"==== end of {job.name}", flush=True)
    for t in threads:
        t.join()

    total = time.monotonic() - started
    print(f"\nlanes: all {len(jobs)} binaries ran in {total:.0f}s wall "
          f"({sum(j.seconds for j in jobs):.0f}s summed); the longest:")
    for j in sorted(jobs, key=lambda j: -j.seconds)[:20]:
        print(f"  {j.seconds:7.1f}s  {j.name}")
    failed = [j for j in jobs if j.rc != 0]
    if not failed:
        return 0
    print("\nfailed tests:")
    for j in failed:
        with open(j.log, encoding="utf-8", errors="replace") as f:
            names = sorted({m.group(1) for m in
                            re.finditer(r"^test (.*) \.\.\. FAILED$", f.read(), re.M)})
        for n in names:
            print(f"  {n}  ({j.name})")
        if not names:
            print(f"  (no test named; the binary itself failed)  ({j.name})")
    print("failed test binaries (rerun one with the command shown; its full log):")
    for j in failed:
        print(f"    `{j.rerun}`  {j.log}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
