//! The BMC operations the Machine lifecycle uses, over either driver:
//! Redfish ([`crate::redfish`]) or IPMI ([`crate::ipmi`]). The lifecycle
//! handlers stay pure; the driver calls these.

use std::time::Duration;

use crate::ipmi::{IpmiClient, IpmiError};
use crate::redfish::{
    BmcReason, BootTarget, RedfishClient, RedfishError, ResetType, ShutdownOutcome,
};

/// Errors of either driver.
#[derive(Debug, thiserror::Error)]
pub enum BmcError {
    /// A Redfish failure.
    #[error(transparent)]
    Redfish(#[from] RedfishError),
    /// An IPMI failure.
    #[error(transparent)]
    Ipmi(#[from] IpmiError),
}

impl BmcError {
    /// The `BMCReachable` reason of this failure.
    pub fn reason(&self) -> BmcReason {
        match self {
            Self::Redfish(e) => e.reason(),
            Self::Ipmi(e) => e.reason(),
        }
    }
}

/// What the lifecycle reads from a BMC before deciding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SystemState {
    /// Powered on (or transitioning on, or paused).
    pub powered_on: bool,
    /// UEFI HTTP boot can be selected (never over IPMI).
    pub offers_http_boot: bool,
}

/// A client for one BMC.
#[derive(Debug)]
pub enum BmcClient {
    /// `redfish://`, `redfish+http://`.
    Redfish(RedfishClient),
    /// `ipmi://`.
    Ipmi(IpmiClient),
}

impl BmcClient {
    /// Power state and capabilities.
    pub async fn system(&self) -> Result<SystemState, BmcError> {
        Ok(match self {
            Self::Redfish(c) => {
                let sys = c.system().await?;
                SystemState {
                    powered_on: sys.power_state.is_on(),
                    offers_http_boot: sys.offers_http_boot(),
                }
            }
            Self::Ipmi(c) => SystemState {
                powered_on: c.power_state().await?.is_on(),
                offers_http_boot: false,
            },
        })
    }

    /// A power action.
    pub async fn reset(&self, kind: ResetType) -> Result<(), BmcError> {
        match self {
            Self::Redfish(c) => c.reset(kind).await?,
            Self::Ipmi(c) => c.reset(kind).await?,
        }
        Ok(())
    }

    /// A one-time boot override to `target` in UEFI mode.
    pub async fn set_boot_once(&self, target: BootTarget) -> Result<(), BmcError> {
        match self {
            Self::Redfish(c) => c.set_boot_once(target).await?,
            Self::Ipmi(c) => c.set_boot_once(target).await?,
        }
        Ok(())
    }

    /// Clears any boot override.
    pub async fn clear_boot_override(&self) -> Result<(), BmcError> {
        match self {
            Self::Redfish(c) => c.clear_boot_override().await?,
            Self::Ipmi(c) => c.clear_boot_override().await?,
        }
        Ok(())
    }

    /// Graceful shutdown, forced after `timeout`.
    pub async fn shutdown(
        &self,
        timeout: Duration,
        poll: Duration,
    ) -> Result<ShutdownOutcome, BmcError> {
        Ok(match self {
            Self::Redfish(c) => c.shutdown(timeout, poll).await?,
            Self::Ipmi(c) => c.shutdown(timeout, poll).await?,
        })
    }
}
