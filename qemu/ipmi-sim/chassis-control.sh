#!/bin/sh
# chassis-control.sh: the `chassis_control` program of an ipmi_sim that
# stands in for a machine's BMC in anneal's tests (issue 16).
#
#   chassis-control.sh STATE_DIR get PARM...        prints PARM:VALUE lines
#   chassis-control.sh STATE_DIR set PARM VALUE...  (ipmi_sim appends these)
#
# PARM is power (0/1), reset (pulse), shutdown (soft, pulse), boot (none,
# pxe, default, cdrom, bios) or identify. The state lives in STATE_DIR:
# `power` (0/1), `boot` (the device ipmi_sim passed), and `calls`, one line
# per set (e.g. "set power 1"), which the tests read. When STATE_DIR holds
# an executable `hook`, each set also runs `hook STATE_DIR PARM VALUE` (the lifecycle
# test drives its QEMU VM through it) and fails when the hook fails.
dir=$1
op=$2
shift 2 || exit 1
[ -d "$dir" ] || { echo "no state directory $dir"; exit 1; }
[ -f "$dir/power" ] || echo 0 > "$dir/power"
[ -f "$dir/boot" ] || echo default > "$dir/boot"
case $op in
get)
    for parm in "$@"; do
        case $parm in
        power) echo "power:$(cat "$dir/power")" ;;
        boot) echo "boot:$(cat "$dir/boot")" ;;
        *) echo "invalid parameter $parm"; exit 1 ;;
        esac
    done
    ;;
set)
    while [ $# -ge 2 ]; do
        parm=$1 val=$2
        shift 2
        if [ "$parm" = identify ]; then
            shift 1 2>/dev/null || true
        fi
        echo "set $parm $val" >> "$dir/calls"
        case $parm in
        power) echo "$val" > "$dir/power" ;;
        shutdown) echo 0 > "$dir/power" ;;
        reset) ;;
        boot) echo "$val" > "$dir/boot" ;;
        identify) ;;
        *) echo "invalid parameter $parm"; exit 1 ;;
        esac
        if [ -x "$dir/hook" ]; then
            "$dir/hook" "$dir" "$parm" "$val" || { echo "hook failed for $parm $val"; exit 1; }
        fi
    done
    ;;
check) exit 1 ;;
*) echo "unknown operation $op"; exit 1 ;;
esac
