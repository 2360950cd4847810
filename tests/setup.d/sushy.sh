# sushy-tools (PyPI) in a private virtualenv: its `sushy-emulator --fake`
# serves a Redfish ComputerSystem without libvirt; the Redfish client
# conformance tests run against it and against anneal-qemu-bmc.
# Sourced by tests/setup.sh as root; a re-run on a ready machine is instant.
sushy_venv="${ANNEAL_CACHE:-/var/cache/anneal}/sushy"
sushy_bin="${ANNEAL_CACHE:-/var/cache/anneal}/bin/sushy-emulator"
if [ ! -x "$sushy_bin" ] || ! "$sushy_bin" --help >/dev/null 2>&1; then
  if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null
  fi
  python3 -m venv "$sushy_venv"
  "$sushy_venv/bin/pip" install -q --disable-pip-version-check 'sushy-tools>=1.0'
  mkdir -p "$(dirname "$sushy_bin")"
  ln -sf "$sushy_venv/bin/sushy-emulator" "$sushy_bin"
fi
