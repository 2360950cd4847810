#!/usr/bin/env python3
"""qmp-hook.py STATE_DIR PARM VALUE: the chassis-control hook that turns
ipmi_sim's chassis sets into QMP commands to the VM whose QMP socket is
STATE_DIR/qmp (a VM started paused with -S and -no-shutdown, like the ones
behind anneal-qemu-bmc):

  power 1     reset and run the VM if it is stopped
  power 0     stop it (the chassis is off)
  reset 1     system_reset
  shutdown 1  stop it (the test machine's OS honours the soft shutdown)
  boot, identify: nothing (chassis-control.sh keeps the boot device)
"""
import json
import os
import socket
import sys


def qmp(path, *commands):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    f = s.makefile("rw")
    json.loads(f.readline())  # greeting
    out = []
    for c in ("qmp_capabilities",) + commands:
        f.write(json.dumps({"execute": c}) + "\n")
        f.flush()
        while True:
            r = json.loads(f.readline())
            if "event" in r:
                continue
            if "error" in r:
                raise SystemExit(f"qmp {c}: {r['error']}")
            out.append(r.get("return"))
            break
    s.close()
    return out[1:]


def main():
    state, parm, value = sys.argv[1], sys.argv[2], sys.argv[3]
    path = os.path.join(state, "qmp")
    if parm == "power" and value == "1":
        (status,) = qmp(path, "query-status")
        if not status.get("running"):
            qmp(path, "system_reset", "cont")
    elif parm in ("power", "shutdown"):
        qmp(path, "stop")
    elif parm == "reset":
        qmp(path, "system_reset")


if __name__ == "__main__":
    main()
