//! Boot-chain types shared by the Machine kind (feature `crd`) and bootd's
//! DHCP core (which builds without the cluster dependencies).

use serde::{Deserialize, Serialize};

/// The network boot chain of a machine (Machine `spec.bootLoader`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum BootLoader {
    /// iPXE, then the agent.
    #[default]
    Ipxe,
    /// Debian's signed shim and network GRUB, then the signed kernel (UEFI
    /// Secure Boot with the Microsoft UEFI CA; BIOS clients still get iPXE).
    Shim,
}
