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

Each reset (power 1 of a stopped VM, reset 1) boots the device
chassis-control.sh keeps in STATE_DIR/boot, like anneal-qemu-bmc: "pxe"
puts the NICs first in the firmware's boot order (QOM bootindex, which QEMU
hands to the firmware at the reset), anything else the disks. The order is
put back to disks first after the reset: the flags anneal sets are one-time
(valid for the next boot only). Each such boot is appended to
STATE_DIR/calls as "vm boot network" or "vm boot disk".
"""
import json
import os
import socket
import sys


def qmp(path, *commands, strict=True):
    """Runs commands (a name, or (name, arguments)); their returns. Not
    strict: a command's error is returned as None instead of exiting."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    f = s.makefile("rw")
    json.loads(f.readline())  # greeting
    out = []
    for c in ("qmp_capabilities",) + commands:
        c, args = c if isinstance(c, tuple) else (c, None)
        msg = {"execute": c}
        if args is not None:
            msg["arguments"] = args
        f.write(json.dumps(msg) + "\n")
        f.flush()
        while True:
            r = json.loads(f.readline())
            if "event" in r:
                continue
            if "error" in r and strict:
                raise SystemExit(f"qmp {c}: {r['error']}")
            out.append(r.get("return"))
            break
    s.close()
    return out[1:]


def boot_devices(path):
    """QOM paths of the NICs and disks, as (path, is_network)."""
    out = []
    for parent in ("/machine/peripheral", "/machine/peripheral-anon"):
        try:
            (children,) = qmp(path, ("qom-list", {"path": parent}))
        except SystemExit:
            continue
        for child in children:
            kind = child.get("type", "")
            if not (kind.startswith("child<") and kind.endswith(">")):
                continue
            kind = kind[6:-1]
            net = "net" in kind or kind.startswith("e1000") or kind == "rtl8139"
            disk = "blk" in kind or kind in ("nvme", "ide-hd") or "scsi-hd" in kind
            if net or disk:
                out.append((parent + "/" + child["name"], net))
    return sorted(out)


def set_order(path, devices, network_first):
    order = sorted(devices, key=lambda d: d[1] != network_first)
    cmds = [("qom-set", {"path": p, "property": "bootindex", "value": -1}) for p, _ in devices]
    cmds += [
        ("qom-set", {"path": p, "property": "bootindex", "value": i + 1})
        for i, (p, _) in enumerate(order)
    ]
    # a device without a boot ROM may refuse an index: boot what remains
    qmp(path, *cmds, strict=False)


def boot(state, path, start):
    """Resets the VM into the kept boot device (and runs it with start)."""
    with open(os.path.join(state, "boot")) as f:
        network = f.read().strip() == "pxe"
    devices = boot_devices(path)
    set_order(path, devices, network)
    qmp(path, "system_reset", *(("cont",) if start else ()))
    if network:
        set_order(path, devices, False)
    with open(os.path.join(state, "calls"), "a") as f:
        f.write("vm boot %s\n" % ("network" if network else "disk"))


def main():
    state, parm, value = sys.argv[1], sys.argv[2], sys.argv[3]
    path = os.path.join(state, "qmp")
    if parm == "power" and value == "1":
        (status,) = qmp(path, "query-status")
        if not status.get("running"):
            boot(state, path, True)
    elif parm in ("power", "shutdown"):
        qmp(path, "stop")
    elif parm == "reset":
        boot(state, path, False)


if __name__ == "__main__":
    main()
