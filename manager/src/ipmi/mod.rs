//! IPMI driver (`ipmi://host[:port]`, docs/lifecycle.md "BMC access and
//! failures"): IPMI 2.0 RMCP+ "lanplus" over UDP with cipher suite 3
//! (RAKP-HMAC-SHA1, HMAC-SHA1-96, AES-CBC-128). One session per operation:
//! open, RAKP 1-4, raise the privilege to administrator, the commands, close.
//! Each request is sent up to [`ATTEMPTS`] times within the client's timeout.
//!
//! The pure encodings and the key derivation live in [`wire`] (golden
//! vectors from ipmitool against ipmi_sim in its tests).

pub mod wire;

use std::net::SocketAddr;
use std::time::Duration;

use anneal_api::agent::Token;
use tokio::net::UdpSocket;

use crate::redfish::{BmcReason, BootTarget, PowerState, ResetType, ShutdownOutcome};
use wire::{BootDevice, ChassisControl, Keys, PayloadType, WireError, cmd, netfn};

/// Sends of one request before the BMC counts as unreachable.
pub const ATTEMPTS: u32 = 3;
/// The default UDP port.
pub const DEFAULT_PORT: u16 = 623;

/// Errors of the IPMI driver; each names the BMC address.
#[derive(Debug, thiserror::Error)]
pub enum IpmiError {
    /// The host does not resolve, or no socket could be opened.
    #[error("bmc {bmc}: cannot reach it")]
    Socket {
        /// host:port
        bmc: String,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// No answer after every attempt.
    #[error("bmc {bmc}: no answer to {what} after {attempts} attempts within {timeout:?}")]
    Timeout {
        /// host:port
        bmc: String,
        /// the request
        what: &'static str,
        /// attempts made
        attempts: u32,
        /// the client timeout
        timeout: Duration,
    },
    /// The BMC refused the session (RMCP+ status code).
    #[error("bmc {bmc}: {stage} refused with rmcp+ status {code:#04x} ({})", wire::rmcpp_status(*code))]
    Refused {
        /// host:port
        bmc: String,
        /// open session, rakp 2 or rakp 4
        stage: &'static str,
        /// status code
        code: u8,
    },
    /// The BMC's RAKP 2 code does not verify with the password: wrong
    /// password (or user).
    #[error(
        "bmc {bmc}: rakp 2 does not verify with the password of user {user:?}: the password is wrong"
    )]
    WrongPassword {
        /// host:port
        bmc: String,
        /// the user
        user: String,
    },
    /// RAKP 4 does not verify.
    #[error("bmc {bmc}: rakp 4 integrity check value does not verify")]
    Rakp4 {
        /// host:port
        bmc: String,
    },
    /// The BMC does not offer cipher suite 3.
    #[error(
        "bmc {bmc}: the session was opened with algorithms {algorithms:02x?}, not cipher suite 3"
    )]
    CipherSuite {
        /// host:port
        bmc: String,
        /// what it chose
        algorithms: [u8; 3],
    },
    /// A command answered a non-zero completion code.
    #[error("bmc {bmc}: {what} answered completion code {code:#04x} ({})", wire::completion(*code))]
    Completion {
        /// host:port
        bmc: String,
        /// the command
        what: &'static str,
        /// completion code
        code: u8,
    },
    /// The answer does not decode.
    #[error("bmc {bmc}: cannot decode the answer to {what}")]
    Decode {
        /// host:port
        bmc: String,
        /// the request
        what: &'static str,
        /// cause
        #[source]
        source: WireError,
    },
    /// A boot target IPMI cannot select.
    #[error("bmc {bmc}: ipmi cannot select boot target {target} (pxe and disk only)")]
    UnsupportedTarget {
        /// host:port
        bmc: String,
        /// the target
        target: &'static str,
    },
    /// The user name is longer than IPMI allows.
    #[error("bmc {bmc}: user name of {len} bytes is longer than 16")]
    UserName {
        /// host:port
        bmc: String,
        /// its length
        len: usize,
    },
}

impl IpmiError {
    /// The `BMCReachable` reason of this failure.
    pub fn reason(&self) -> BmcReason {
        match self {
            Self::Socket { .. } | Self::Timeout { .. } => BmcReason::BmcUnreachable,
            Self::WrongPassword { .. } => BmcReason::CredentialsRejected,
            Self::Refused {
                code: 0x0a | 0x0d | 0x0f,
                ..
            } => BmcReason::CredentialsRejected,
            _ => BmcReason::QueryFailed,
        }
    }
}

/// An IPMI client for one BMC.
pub struct IpmiClient {
    host: String,
    port: u16,
    username: String,
    password: Token,
    timeout: Duration,
}

impl std::fmt::Debug for IpmiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpmiClient")
            .field("bmc", &self.bmc())
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// An open RMCP+ session.
struct Session {
    sock: UdpSocket,
    keys: Keys,
    bmc_sid: u32,
    seq: u32,
    rq_seq: u8,
}

impl IpmiClient {
    /// A client for `host:port`; `timeout` bounds each request with its
    /// retries.
    pub fn new(host: &str, port: u16, username: &str, password: Token, timeout: Duration) -> Self {
        Self {
            host: host.to_string(),
            port,
            username: username.to_string(),
            password,
            timeout,
        }
    }

    /// `host:port` (IPv6 in brackets), for messages.
    pub fn bmc(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    fn attempt_timeout(&self) -> Duration {
        (self.timeout / ATTEMPTS).max(Duration::from_millis(200))
    }

    /// Sends `packet` and returns the first answer `accept` takes, resending
    /// up to [`ATTEMPTS`] times.
    async fn exchange<T>(
        &self,
        sock: &UdpSocket,
        what: &'static str,
        packet: &[u8],
        mut accept: impl FnMut(&[u8]) -> Option<Result<T, IpmiError>>,
    ) -> Result<T, IpmiError> {
        let mut buf = vec![0u8; 1024];
        for _ in 0..ATTEMPTS {
            sock.send(packet)
                .await
                .map_err(|source| self.socket(source))?;
            let deadline = tokio::time::Instant::now() + self.attempt_timeout();
            loop {
                match tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
                    Err(_) => break,
                    Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        // ICMP port unreachable: wait out this attempt.
                        tokio::time::sleep_until(deadline).await;
                        break;
                    }
                    Ok(Err(source)) => return Err(self.socket(source)),
                    Ok(Ok(n)) => {
                        if let Some(r) = accept(&buf[..n]) {
                            return r;
                        }
                    }
                }
            }
        }
        Err(IpmiError::Timeout {
            bmc: self.bmc(),
            what,
            attempts: ATTEMPTS,
            timeout: self.timeout,
        })
    }

    fn socket(&self, source: std::io::Error) -> IpmiError {
        IpmiError::Socket {
            bmc: self.bmc(),
            source,
        }
    }

    fn decode(&self, what: &'static str) -> impl Fn(WireError) -> IpmiError + '_ {
        move |source| IpmiError::Decode {
            bmc: self.bmc(),
            what,
            source,
        }
    }

    async fn connect(&self) -> Result<UdpSocket, IpmiError> {
        let target: SocketAddr = tokio::net::lookup_host((self.host.as_str(), self.port))
            .await
            .map_err(|source| self.socket(source))?
            .next()
            .ok_or_else(|| {
                self.socket(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "host resolves to no address",
                ))
            })?;
        let local: SocketAddr = if target.is_ipv4() {
            "0.0.0.0:0".parse().unwrap_or(target)
        } else {
            "[::]:0".parse().unwrap_or(target)
        };
        let sock = UdpSocket::bind(local)
            .await
            .map_err(|source| self.socket(source))?;
        sock.connect(target)
            .await
            .map_err(|source| self.socket(source))?;
        Ok(sock)
    }

    /// Opens a session: Open Session, RAKP 1-4, privilege administrator.
    async fn open(&self) -> Result<Session, IpmiError> {
        let user = self.username.as_bytes();
        if user.len() > 16 {
            return Err(IpmiError::UserName {
                bmc: self.bmc(),
                len: user.len(),
            });
        }
        let sock = self.connect().await?;
        let console_sid = rand::random::<u32>() | 1;
        let tag = rand::random::<u8>();
        let req = wire::presession_packet(
            PayloadType::OpenSessionRequest,
            &wire::open_session_request(tag, console_sid),
        );
        let open = self
            .exchange(&sock, "open session request", &req, |b| {
                let p = wire::split(b).ok()?;
                if p.payload_type & 0x3f != PayloadType::OpenSessionResponse as u8 {
                    return None;
                }
                let r = wire::parse_open_session_response(p.payload)
                    .map_err(self.decode("open session request"));
                match r {
                    Ok(r) if r.tag != tag => None,
                    r => Some(r),
                }
            })
            .await?;
        if open.status != 0 {
            return Err(IpmiError::Refused {
                bmc: self.bmc(),
                stage: "open session",
                code: open.status,
            });
        }
        if open.algorithms != wire::CIPHER_SUITE_3 {
            return Err(IpmiError::CipherSuite {
                bmc: self.bmc(),
                algorithms: open.algorithms,
            });
        }
        let console_random: [u8; 16] = rand::random();
        let role = wire::ROLE_ADMIN_NAME_ONLY;
        let req = wire::presession_packet(
            PayloadType::Rakp1,
            &wire::rakp1(tag, open.bmc_sid, &console_random, role, user),
        );
        let rakp2 = self
            .exchange(&sock, "rakp 1", &req, |b| {
                let p = wire::split(b).ok()?;
                if p.payload_type & 0x3f != PayloadType::Rakp2 as u8 {
                    return None;
                }
                match wire::parse_rakp2(p.payload).map_err(self.decode("rakp 1")) {
                    Ok(r) if r.tag != tag => None,
                    r => Some(r),
                }
            })
            .await?;
        if rakp2.status != 0 {
            return Err(IpmiError::Refused {
                bmc: self.bmc(),
                stage: "rakp 2",
                code: rakp2.status,
            });
        }
        let hs = wire::Handshake {
            console_sid,
            bmc_sid: open.bmc_sid,
            console_random,
            bmc_random: rakp2.bmc_random,
            bmc_guid: rakp2.bmc_guid,
            role,
            user,
            password: self.password.expose().as_bytes(),
        };
        if !wire::ct_eq(&hs.rakp2_auth_code(), &rakp2.auth_code) {
            return Err(IpmiError::WrongPassword {
                bmc: self.bmc(),
                user: self.username.clone(),
            });
        }
        let keys = hs.keys();
        let req = wire::presession_packet(
            PayloadType::Rakp3,
            &wire::rakp3(tag, open.bmc_sid, &hs.rakp3_auth_code()),
        );
        let rakp4 = self
            .exchange(&sock, "rakp 3", &req, |b| {
                let p = wire::split(b).ok()?;
                if p.payload_type & 0x3f != PayloadType::Rakp4 as u8 {
                    return None;
                }
                match wire::parse_rakp4(p.payload).map_err(self.decode("rakp 3")) {
                    Ok(r) if r.tag != tag => None,
                    r => Some(r),
                }
            })
            .await?;
        if rakp4.status != 0 {
            return Err(IpmiError::Refused {
                bmc: self.bmc(),
                stage: "rakp 4",
                code: rakp4.status,
            });
        }
        if !wire::ct_eq(&hs.rakp4_icv(&keys.sik), &rakp4.icv) {
            return Err(IpmiError::Rakp4 { bmc: self.bmc() });
        }
        let mut session = Session {
            sock,
            keys,
            bmc_sid: open.bmc_sid,
            seq: 0,
            rq_seq: 0,
        };
        self.command(
            &mut session,
            "set session privilege level",
            netfn::APP,
            cmd::SET_SESSION_PRIVILEGE,
            &[wire::PRIV_ADMIN],
        )
        .await?;
        Ok(session)
    }

    /// One command in a session; the response data.
    async fn command(
        &self,
        s: &mut Session,
        what: &'static str,
        netfn: u8,
        command: u8,
        data: &[u8],
    ) -> Result<Vec<u8>, IpmiError> {
        s.seq = s.seq.wrapping_add(1).max(1);
        s.rq_seq = (s.rq_seq + 1) & 0x3f;
        let rq_seq = s.rq_seq;
        let msg = wire::request(netfn, command, rq_seq, data);
        let iv: [u8; 16] = rand::random();
        let packet = wire::session_packet(&s.keys, s.bmc_sid, s.seq, &iv, &msg);
        let keys = s.keys.clone();
        let resp = self
            .exchange(&s.sock, what, &packet, |b| {
                let p = wire::split(b).ok()?;
                if p.payload_type & 0x3f != PayloadType::Ipmi as u8 {
                    return None;
                }
                let m = match wire::open_session_packet(&keys, &p) {
                    Ok(m) => m,
                    Err(e) => return Some(Err(self.decode(what)(e))),
                };
                match wire::parse_response(&m) {
                    Ok(r) if r.rq_seq != rq_seq || r.cmd != command => None,
                    Ok(r) => Some(Ok(r)),
                    Err(e) => Some(Err(self.decode(what)(e))),
                }
            })
            .await?;
        if resp.completion != 0 {
            return Err(IpmiError::Completion {
                bmc: self.bmc(),
                what,
                code: resp.completion,
            });
        }
        Ok(resp.data)
    }

    /// Closes a session (best effort: a BMC times idle sessions out).
    async fn close(&self, mut s: Session) {
        let sid = s.bmc_sid.to_le_bytes();
        if let Err(e) = self
            .command(
                &mut s,
                "close session",
                netfn::APP,
                cmd::CLOSE_SESSION,
                &sid,
            )
            .await
        {
            tracing::debug!(bmc = %self.bmc(), error = %e, "closing the ipmi session failed");
        }
    }

    /// Runs `f` in a fresh session, closed afterwards.
    async fn with_session<T>(
        &self,
        f: impl AsyncFnOnce(&mut Session) -> Result<T, IpmiError>,
    ) -> Result<T, IpmiError> {
        let mut s = self.open().await?;
        let r = f(&mut s).await;
        self.close(s).await;
        r
    }

    /// Get Chassis Status: power on or off.
    pub async fn power_state(&self) -> Result<PowerState, IpmiError> {
        let data = self
            .with_session(async |s| {
                self.command(
                    s,
                    "get chassis status",
                    netfn::CHASSIS,
                    cmd::GET_CHASSIS_STATUS,
                    &[],
                )
                .await
            })
            .await?;
        let byte = data.first().ok_or_else(|| {
            self.decode("get chassis status")(WireError::Truncated {
                what: "chassis status",
                len: 0,
            })
        })?;
        Ok(if byte & 0x01 != 0 {
            PowerState::On
        } else {
            PowerState::Off
        })
    }

    /// Chassis Control.
    pub async fn chassis_control(&self, op: ChassisControl) -> Result<(), IpmiError> {
        self.with_session(async |s| {
            self.command(
                s,
                "chassis control",
                netfn::CHASSIS,
                cmd::CHASSIS_CONTROL,
                &[op as u8],
            )
            .await
        })
        .await?;
        tracing::info!(bmc = %self.bmc(), control = ?op, "ipmi chassis control sent");
        Ok(())
    }

    /// The Redfish reset kinds over Chassis Control: On = power up,
    /// ForceOff = power down, GracefulShutdown = soft shutdown,
    /// ForceRestart and GracefulRestart = hard reset (IPMI has no
    /// graceful reboot).
    pub async fn reset(&self, kind: ResetType) -> Result<(), IpmiError> {
        let op = match kind {
            ResetType::On => ChassisControl::PowerUp,
            ResetType::ForceOff => ChassisControl::PowerDown,
            ResetType::GracefulShutdown => ChassisControl::SoftShutdown,
            ResetType::ForceRestart | ResetType::GracefulRestart => ChassisControl::HardReset,
        };
        self.chassis_control(op).await
    }

    /// Set System Boot Options, boot flags: valid, one-time, EFI, target.
    pub async fn set_boot_once(&self, target: BootTarget) -> Result<(), IpmiError> {
        let device = match target {
            BootTarget::Pxe => BootDevice::Pxe,
            BootTarget::Hdd => BootDevice::Disk,
            BootTarget::UefiHttp => {
                return Err(IpmiError::UnsupportedTarget {
                    bmc: self.bmc(),
                    target: target.as_str(),
                });
            }
        };
        self.with_session(async |s| {
            self.command(
                s,
                "set system boot options",
                netfn::CHASSIS,
                cmd::SET_SYSTEM_BOOT_OPTIONS,
                &wire::boot_flags_once_efi(device),
            )
            .await
        })
        .await?;
        tracing::info!(bmc = %self.bmc(), target = target.as_str(), "ipmi boot flags set (once, efi)");
        Ok(())
    }

    /// Clears the boot flags (valid bit off).
    pub async fn clear_boot_override(&self) -> Result<(), IpmiError> {
        self.with_session(async |s| {
            self.command(
                s,
                "set system boot options",
                netfn::CHASSIS,
                cmd::SET_SYSTEM_BOOT_OPTIONS,
                &wire::BOOT_FLAGS_CLEAR,
            )
            .await
        })
        .await
        .map(drop)
    }

    /// Soft shutdown, then power down if the chassis is not off within
    /// `timeout` (polling every `poll`).
    pub async fn shutdown(
        &self,
        timeout: Duration,
        poll: Duration,
    ) -> Result<ShutdownOutcome, IpmiError> {
        if self.power_state().await? == PowerState::Off {
            return Ok(ShutdownOutcome::AlreadyOff);
        }
        self.chassis_control(ChassisControl::SoftShutdown).await?;
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            tokio::time::sleep(poll).await;
            if self.power_state().await? == PowerState::Off {
                return Ok(ShutdownOutcome::Graceful);
            }
        }
        self.chassis_control(ChassisControl::PowerDown).await?;
        Ok(ShutdownOutcome::Forced)
    }
}
