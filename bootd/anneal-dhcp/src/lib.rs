//! DHCPv4 server core for network boot: pure decode-and-decide, PXE and iPXE options.
