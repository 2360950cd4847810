//! The pure core of IPMI 2.0 RMCP+ ("lanplus") with cipher suite 3
//! (RAKP-HMAC-SHA1, HMAC-SHA1-96 integrity, AES-CBC-128 confidentiality):
//! packet encodings, the RAKP key derivation (SIK, K1, K2), payload
//! sealing and opening. No I/O: the socket lives in `super`.
//!
//! References: IPMI v2.0 rev 1.1, sections 13.6 (RMCP+ session header),
//! 13.17-13.31 (open session, RAKP 1-4, keys), 13.28-13.29 (integrity,
//! confidentiality), 22-28 (commands).

use aes::Aes128;
use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit, generic_array::GenericArray};
use hmac::{Hmac, Mac};
use sha1::Sha1;

type HmacSha1 = Hmac<Sha1>;

/// RMCP header: version 6, reserved, sequence 0xFF (no ack), class IPMI.
pub const RMCP_HEADER: [u8; 4] = [0x06, 0x00, 0xff, 0x07];
/// Authentication type "RMCP+" of the IPMI 2.0 session header.
pub const AUTH_RMCPP: u8 = 0x06;
/// Requester address of the remote console (software ID 0x40 << 1 | 1).
pub const RQ_ADDR: u8 = 0x81;
/// Responder address of the BMC.
pub const RS_ADDR: u8 = 0x20;
/// Privilege level administrator.
pub const PRIV_ADMIN: u8 = 0x04;
/// RAKP 1 role: administrator, name-only lookup (as ipmitool asks).
pub const ROLE_ADMIN_NAME_ONLY: u8 = 0x10 | PRIV_ADMIN;
/// Length of an HMAC-SHA1-96 integrity code.
pub const AUTHCODE_LEN: usize = 12;

/// Payload types of the session header (low 6 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PayloadType {
    /// An IPMI message.
    Ipmi = 0x00,
    /// RMCP+ Open Session Request.
    OpenSessionRequest = 0x10,
    /// RMCP+ Open Session Response.
    OpenSessionResponse = 0x11,
    /// RAKP Message 1.
    Rakp1 = 0x12,
    /// RAKP Message 2.
    Rakp2 = 0x13,
    /// RAKP Message 3.
    Rakp3 = 0x14,
    /// RAKP Message 4.
    Rakp4 = 0x15,
}

/// Errors decoding what the BMC sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Too short for what it claims.
    #[error("{what}: packet of {len} bytes is truncated")]
    Truncated {
        /// which structure
        what: &'static str,
        /// bytes received
        len: usize,
    },
    /// Not an RMCP/IPMI 2.0 packet.
    #[error("not an rmcp+ packet (header {0:02x?})")]
    NotRmcpPlus(Vec<u8>),
    /// Another payload type than the one awaited.
    #[error("payload type {got:#04x} where {want:#04x} was awaited")]
    PayloadType {
        /// received
        got: u8,
        /// awaited
        want: u8,
    },
    /// The integrity code does not verify.
    #[error("integrity code does not verify")]
    Integrity,
    /// The encrypted payload does not decrypt into valid padding.
    #[error("confidentiality padding is invalid")]
    Padding,
    /// A checksum of the IPMI message is wrong.
    #[error("ipmi message checksum is wrong")]
    Checksum,
}

/// The algorithms of cipher suite 3.
pub const CIPHER_SUITE_3: [u8; 3] = [0x01, 0x01, 0x01];

/// Open Session Request payload: `tag`, maximum privilege (0: the
/// highest the user may have), the console's session ID, suite 3.
pub fn open_session_request(tag: u8, console_sid: u32) -> Vec<u8> {
    let mut p = vec![tag, 0x00, 0x00, 0x00];
    p.extend_from_slice(&console_sid.to_le_bytes());
    for (kind, algo) in [
        (0u8, CIPHER_SUITE_3[0]),
        (1, CIPHER_SUITE_3[1]),
        (2, CIPHER_SUITE_3[2]),
    ] {
        p.extend_from_slice(&[kind, 0x00, 0x00, 0x08, algo, 0x00, 0x00, 0x00]);
    }
    p
}

/// The parts of an Open Session Response anneal uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenSessionResponse {
    /// Message tag.
    pub tag: u8,
    /// RMCP+ status code (0 = accepted).
    pub status: u8,
    /// The console's session ID echoed.
    pub console_sid: u32,
    /// The session ID the BMC chose.
    pub bmc_sid: u32,
    /// Authentication, integrity and confidentiality algorithms.
    pub algorithms: [u8; 3],
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Parses an Open Session Response payload.
pub fn parse_open_session_response(p: &[u8]) -> Result<OpenSessionResponse, WireError> {
    let trunc = WireError::Truncated {
        what: "open session response",
        len: p.len(),
    };
    if p.len() < 2 {
        return Err(trunc);
    }
    let (tag, status) = (p[0], p[1]);
    if status != 0 {
        // An error answer may stop after the console session ID.
        let console_sid = if p.len() >= 8 { le32(&p[4..8]) } else { 0 };
        return Ok(OpenSessionResponse {
            tag,
            status,
            console_sid,
            bmc_sid: 0,
            algorithms: [0; 3],
        });
    }
    if p.len() < 36 {
        return Err(trunc);
    }
    Ok(OpenSessionResponse {
        tag,
        status,
        console_sid: le32(&p[4..8]),
        bmc_sid: le32(&p[8..12]),
        algorithms: [p[16], p[24], p[32]],
    })
}

/// RAKP Message 1 payload.
pub fn rakp1(tag: u8, bmc_sid: u32, console_random: &[u8; 16], role: u8, user: &[u8]) -> Vec<u8> {
    let mut p = vec![tag, 0, 0, 0];
    p.extend_from_slice(&bmc_sid.to_le_bytes());
    p.extend_from_slice(console_random);
    p.push(role);
    p.extend_from_slice(&[0, 0]);
    p.push(user.len() as u8);
    p.extend_from_slice(user);
    p
}

/// RAKP Message 2, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rakp2 {
    /// Message tag.
    pub tag: u8,
    /// RMCP+ status code (0 = accepted).
    pub status: u8,
    /// The console's session ID.
    pub console_sid: u32,
    /// The BMC's random number.
    pub bmc_random: [u8; 16],
    /// The BMC's GUID.
    pub bmc_guid: [u8; 16],
    /// HMAC-SHA1 key exchange authentication code.
    pub auth_code: Vec<u8>,
}

/// Parses a RAKP Message 2 payload.
pub fn parse_rakp2(p: &[u8]) -> Result<Rakp2, WireError> {
    let trunc = WireError::Truncated {
        what: "rakp 2",
        len: p.len(),
    };
    if p.len() < 2 {
        return Err(trunc);
    }
    if p[1] != 0 {
        return Ok(Rakp2 {
            tag: p[0],
            status: p[1],
            console_sid: 0,
            bmc_random: [0; 16],
            bmc_guid: [0; 16],
            auth_code: Vec::new(),
        });
    }
    if p.len() < 40 {
        return Err(trunc);
    }
    let mut bmc_random = [0; 16];
    bmc_random.copy_from_slice(&p[8..24]);
    let mut bmc_guid = [0; 16];
    bmc_guid.copy_from_slice(&p[24..40]);
    Ok(Rakp2 {
        tag: p[0],
        status: p[1],
        console_sid: le32(&p[4..8]),
        bmc_random,
        bmc_guid,
        auth_code: p[40..].to_vec(),
    })
}

/// RAKP Message 3 payload.
pub fn rakp3(tag: u8, bmc_sid: u32, auth_code: &[u8]) -> Vec<u8> {
    let mut p = vec![tag, 0, 0, 0];
    p.extend_from_slice(&bmc_sid.to_le_bytes());
    p.extend_from_slice(auth_code);
    p
}

/// RAKP Message 4, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rakp4 {
    /// Message tag.
    pub tag: u8,
    /// RMCP+ status code (0 = accepted).
    pub status: u8,
    /// The console's session ID.
    pub console_sid: u32,
    /// Integrity check value (HMAC-SHA1-96 with the SIK).
    pub icv: Vec<u8>,
}

/// Parses a RAKP Message 4 payload.
pub fn parse_rakp4(p: &[u8]) -> Result<Rakp4, WireError> {
    if p.len() < 2 || (p[1] == 0 && p.len() < 8) {
        return Err(WireError::Truncated {
            what: "rakp 4",
            len: p.len(),
        });
    }
    Ok(Rakp4 {
        tag: p[0],
        status: p[1],
        console_sid: if p.len() >= 8 { le32(&p[4..8]) } else { 0 },
        icv: p.get(8..).unwrap_or_default().to_vec(),
    })
}

/// Everything RAKP binds together.
#[derive(Debug, Clone)]
pub struct Handshake<'a> {
    /// The console's session ID (SIDm).
    pub console_sid: u32,
    /// The BMC's session ID (SIDc).
    pub bmc_sid: u32,
    /// The console's random number (Rm).
    pub console_random: [u8; 16],
    /// The BMC's random number (Rc).
    pub bmc_random: [u8; 16],
    /// The BMC's GUID (GUIDc).
    pub bmc_guid: [u8; 16],
    /// The role byte sent in RAKP 1 (ROLEm).
    pub role: u8,
    /// The user name (UNAMEm).
    pub user: &'a [u8],
    /// The password (Kuid; also Kg when the BMC has no BMC key).
    pub password: &'a [u8],
}

fn hmac_sha1(key: &[u8], parts: &[&[u8]]) -> [u8; 20] {
    // HMAC accepts keys of any length: this cannot fail.
    let mut mac = match <HmacSha1 as Mac>::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => return [0; 20],
    };
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

/// The user key Kuid: the password, zero-padded to 20 bytes.
fn kuid(password: &[u8]) -> [u8; 20] {
    let mut k = [0u8; 20];
    let n = password.len().min(20);
    k[..n].copy_from_slice(&password[..n]);
    k
}

/// Session keys derived from a RAKP exchange.
#[derive(Clone, PartialEq, Eq)]
pub struct Keys {
    /// Session integrity key.
    pub sik: [u8; 20],
    /// K1: integrity (HMAC-SHA1-96) key.
    pub k1: [u8; 20],
    /// K2: its first 16 bytes are the AES-128 key.
    pub k2: [u8; 20],
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(redacted)")
    }
}

impl Handshake<'_> {
    fn user_len(&self) -> [u8; 1] {
        [self.user.len() as u8]
    }

    /// The auth code the BMC must have put into RAKP 2.
    pub fn rakp2_auth_code(&self) -> [u8; 20] {
        hmac_sha1(
            &kuid(self.password),
            &[
                &self.console_sid.to_le_bytes(),
                &self.bmc_sid.to_le_bytes(),
                &self.console_random,
                &self.bmc_random,
                &self.bmc_guid,
                &[self.role],
                &self.user_len(),
                self.user,
            ],
        )
    }

    /// The auth code of RAKP 3.
    pub fn rakp3_auth_code(&self) -> [u8; 20] {
        hmac_sha1(
            &kuid(self.password),
            &[
                &self.bmc_random,
                &self.console_sid.to_le_bytes(),
                &[self.role],
                &self.user_len(),
                self.user,
            ],
        )
    }

    /// SIK, K1 and K2 (Kg = Kuid: no BMC key).
    pub fn keys(&self) -> Keys {
        let sik = hmac_sha1(
            &kuid(self.password),
            &[
                &self.console_random,
                &self.bmc_random,
                &[self.role],
                &self.user_len(),
                self.user,
            ],
        );
        Keys {
            k1: hmac_sha1(&sik, &[&[0x01; 20]]),
            k2: hmac_sha1(&sik, &[&[0x02; 20]]),
            sik,
        }
    }

    /// The integrity check value RAKP 4 must carry (HMAC-SHA1-96 with SIK).
    pub fn rakp4_icv(&self, sik: &[u8; 20]) -> [u8; AUTHCODE_LEN] {
        let full = hmac_sha1(
            sik,
            &[
                &self.console_random,
                &self.bmc_sid.to_le_bytes(),
                &self.bmc_guid,
            ],
        );
        let mut out = [0; AUTHCODE_LEN];
        out.copy_from_slice(&full[..AUTHCODE_LEN]);
        out
    }
}

/// Compares in constant time.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A pre-session packet (session ID and sequence 0, no integrity).
pub fn presession_packet(kind: PayloadType, payload: &[u8]) -> Vec<u8> {
    let mut p = RMCP_HEADER.to_vec();
    p.push(AUTH_RMCPP);
    p.push(kind as u8);
    p.extend_from_slice(&[0; 8]);
    p.extend_from_slice(&(payload.len() as u16).to_le_bytes());
    p.extend_from_slice(payload);
    p
}

/// A received RMCP+ packet, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Payload type byte (with the encrypted/authenticated bits).
    pub payload_type: u8,
    /// Session ID.
    pub sid: u32,
    /// Session sequence number.
    pub seq: u32,
    /// Payload (still encrypted when bit 7 of the type is set).
    pub payload: &'a [u8],
    /// Bytes covered by the integrity code (auth type to next header).
    pub signed: &'a [u8],
    /// The integrity code.
    pub auth_code: &'a [u8],
}

/// Splits a received packet.
pub fn split(packet: &[u8]) -> Result<Packet<'_>, WireError> {
    let trunc = WireError::Truncated {
        what: "rmcp+ packet",
        len: packet.len(),
    };
    if packet.len() < 16 {
        return Err(trunc);
    }
    if packet[..4] != RMCP_HEADER[..] || packet[4] != AUTH_RMCPP {
        return Err(WireError::NotRmcpPlus(
            packet[..5.min(packet.len())].to_vec(),
        ));
    }
    let payload_type = packet[5];
    if payload_type & 0x3f == 0x02 {
        // OEM explicit payloads carry six more header bytes: unused here.
        return Err(WireError::NotRmcpPlus(packet[..6].to_vec()));
    }
    let sid = le32(&packet[6..10]);
    let seq = le32(&packet[10..14]);
    let len = u16::from_le_bytes([packet[14], packet[15]]) as usize;
    let end = 16 + len;
    if packet.len() < end {
        return Err(trunc);
    }
    let payload = &packet[16..end];
    let (signed, auth_code) = if payload_type & 0x40 != 0 {
        // pad to 4 (from the auth type), pad length, next header, code
        let code_at = packet
            .len()
            .checked_sub(AUTHCODE_LEN)
            .ok_or(trunc.clone())?;
        if code_at < end + 2 {
            return Err(trunc);
        }
        (&packet[4..code_at], &packet[code_at..])
    } else {
        (&packet[4..end], &packet[end..end])
    };
    Ok(Packet {
        payload_type,
        sid,
        seq,
        payload,
        signed,
        auth_code,
    })
}

/// AES-CBC-128 with the IPMI padding (1, 2, 3, … then the pad length).
fn encrypt(k2: &[u8; 20], iv: &[u8; 16], plain: &[u8]) -> Vec<u8> {
    let cipher = Aes128::new(GenericArray::from_slice(&k2[..16]));
    let pad = (16 - (plain.len() + 1) % 16) % 16;
    let mut data = plain.to_vec();
    data.extend((1..=pad as u8).collect::<Vec<_>>());
    data.push(pad as u8);
    let mut out = iv.to_vec();
    let mut prev = *iv;
    for chunk in data.chunks(16) {
        let mut block = [0u8; 16];
        for (i, b) in block.iter_mut().enumerate() {
            *b = chunk[i] ^ prev[i];
        }
        let mut ga = GenericArray::from(block);
        cipher.encrypt_block(&mut ga);
        prev.copy_from_slice(&ga);
        out.extend_from_slice(&ga);
    }
    out
}

/// Decrypts an AES-CBC-128 payload (IV first) and strips its padding.
pub fn decrypt(k2: &[u8; 20], payload: &[u8]) -> Result<Vec<u8>, WireError> {
    if payload.len() < 32 || !payload.len().is_multiple_of(16) {
        return Err(WireError::Padding);
    }
    let cipher = Aes128::new(GenericArray::from_slice(&k2[..16]));
    let mut prev = [0u8; 16];
    prev.copy_from_slice(&payload[..16]);
    let mut out = Vec::with_capacity(payload.len() - 16);
    for chunk in payload[16..].chunks(16) {
        let mut ga = GenericArray::clone_from_slice(chunk);
        cipher.decrypt_block(&mut ga);
        for i in 0..16 {
            out.push(ga[i] ^ prev[i]);
        }
        prev.copy_from_slice(chunk);
    }
    let pad = *out.last().ok_or(WireError::Padding)? as usize;
    if pad >= 16 || pad + 1 > out.len() {
        return Err(WireError::Padding);
    }
    let body = out.len() - pad - 1;
    if out[body..out.len() - 1]
        .iter()
        .enumerate()
        .any(|(i, b)| *b as usize != i + 1)
    {
        return Err(WireError::Padding);
    }
    out.truncate(body);
    Ok(out)
}

/// A session packet carrying an encrypted, authenticated IPMI message.
pub fn session_packet(keys: &Keys, bmc_sid: u32, seq: u32, iv: &[u8; 16], msg: &[u8]) -> Vec<u8> {
    let payload = encrypt(&keys.k2, iv, msg);
    let mut p = RMCP_HEADER.to_vec();
    p.push(AUTH_RMCPP);
    p.push(0xc0 | PayloadType::Ipmi as u8);
    p.extend_from_slice(&bmc_sid.to_le_bytes());
    p.extend_from_slice(&seq.to_le_bytes());
    p.extend_from_slice(&(payload.len() as u16).to_le_bytes());
    p.extend_from_slice(&payload);
    // integrity pad: auth type .. pad length + next header, multiple of 4
    let covered = p.len() - 4 + 2;
    let pad = (4 - covered % 4) % 4;
    p.extend(std::iter::repeat_n(0xff, pad));
    p.push(pad as u8);
    p.push(0x07);
    let code = hmac_sha1(&keys.k1, &[&p[4..]]);
    p.extend_from_slice(&code[..AUTHCODE_LEN]);
    p
}

/// Verifies and opens a received session packet: its IPMI message.
pub fn open_session_packet(keys: &Keys, packet: &Packet<'_>) -> Result<Vec<u8>, WireError> {
    if packet.payload_type & 0x3f != PayloadType::Ipmi as u8 {
        return Err(WireError::PayloadType {
            got: packet.payload_type & 0x3f,
            want: PayloadType::Ipmi as u8,
        });
    }
    if packet.payload_type & 0x40 != 0 {
        let code = hmac_sha1(&keys.k1, &[packet.signed]);
        if !ct_eq(&code[..AUTHCODE_LEN], packet.auth_code) {
            return Err(WireError::Integrity);
        }
    }
    if packet.payload_type & 0x80 != 0 {
        decrypt(&keys.k2, packet.payload)
    } else {
        Ok(packet.payload.to_vec())
    }
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |a, b| a.wrapping_add(*b))
        .wrapping_neg()
}

/// An IPMI LAN request message to the BMC (LUN 0).
pub fn request(netfn: u8, cmd: u8, rq_seq: u8, data: &[u8]) -> Vec<u8> {
    let mut m = vec![RS_ADDR, netfn << 2];
    m.push(checksum(&m));
    let start = m.len();
    m.extend_from_slice(&[RQ_ADDR, (rq_seq & 0x3f) << 2, cmd]);
    m.extend_from_slice(data);
    let c = checksum(&m[start..]);
    m.push(c);
    m
}

/// An IPMI LAN response, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Response network function (request's + 1).
    pub netfn: u8,
    /// Requester sequence (6 bits).
    pub rq_seq: u8,
    /// Command.
    pub cmd: u8,
    /// Completion code.
    pub completion: u8,
    /// Data after the completion code.
    pub data: Vec<u8>,
}

/// Parses an IPMI LAN response message.
pub fn parse_response(m: &[u8]) -> Result<Response, WireError> {
    if m.len() < 8 {
        return Err(WireError::Truncated {
            what: "ipmi response",
            len: m.len(),
        });
    }
    if checksum(&m[..2]) != m[2] || checksum(&m[3..m.len() - 1]) != m[m.len() - 1] {
        return Err(WireError::Checksum);
    }
    Ok(Response {
        netfn: m[1] >> 2,
        rq_seq: m[4] >> 2,
        cmd: m[5],
        completion: m[6],
        data: m[7..m.len() - 1].to_vec(),
    })
}

/// Network functions.
pub mod netfn {
    /// Chassis.
    pub const CHASSIS: u8 = 0x00;
    /// Application.
    pub const APP: u8 = 0x06;
}

/// Commands.
pub mod cmd {
    /// Get Chassis Status (chassis).
    pub const GET_CHASSIS_STATUS: u8 = 0x01;
    /// Chassis Control (chassis).
    pub const CHASSIS_CONTROL: u8 = 0x02;
    /// Set System Boot Options (chassis).
    pub const SET_SYSTEM_BOOT_OPTIONS: u8 = 0x08;
    /// Get System Boot Options (chassis).
    pub const GET_SYSTEM_BOOT_OPTIONS: u8 = 0x09;
    /// Set Session Privilege Level (app).
    pub const SET_SESSION_PRIVILEGE: u8 = 0x3b;
    /// Close Session (app).
    pub const CLOSE_SESSION: u8 = 0x3c;
}

/// Chassis Control operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ChassisControl {
    /// Power down (no OS shutdown).
    PowerDown = 0x00,
    /// Power up.
    PowerUp = 0x01,
    /// Power cycle (off, then on after at least 1 s).
    PowerCycle = 0x02,
    /// Hard reset.
    HardReset = 0x03,
    /// Soft shutdown through ACPI (the overtemperature emulation).
    SoftShutdown = 0x05,
}

/// Boot devices of boot flags (parameter 5, data byte 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BootDevice {
    /// Force PXE.
    Pxe = 0x04,
    /// Force boot from the default hard drive.
    Disk = 0x08,
}

/// Set System Boot Options data: parameter 5 (boot flags), valid,
/// one-time (not persistent), EFI, `device`.
pub fn boot_flags_once_efi(device: BootDevice) -> [u8; 6] {
    [0x05, 0x80 | 0x20, device as u8, 0x00, 0x00, 0x00]
}

/// Set System Boot Options data clearing the boot flags (not valid).
pub const BOOT_FLAGS_CLEAR: [u8; 6] = [0x05, 0x00, 0x00, 0x00, 0x00, 0x00];

/// The RMCP+ status codes of docs (section 13.24), for messages.
pub fn rmcpp_status(code: u8) -> &'static str {
    match code {
        0x01 => "insufficient resources to create a session",
        0x02 => "invalid session id",
        0x03 => "invalid payload type",
        0x04 => "invalid authentication algorithm",
        0x05 => "invalid integrity algorithm",
        0x06 => "no matching authentication payload",
        0x07 => "no matching integrity payload",
        0x08 => "inactive session id",
        0x09 => "invalid role",
        0x0a => "unauthorized role or privilege level requested",
        0x0b => "insufficient resources to create a session at the requested role",
        0x0c => "invalid name length",
        0x0d => "unauthorized name",
        0x0e => "unauthorized guid",
        0x0f => "invalid integrity check value",
        0x10 => "invalid confidentiality algorithm",
        0x11 => "no cipher suite match with proposed security algorithms",
        0x12 => "illegal or unrecognized parameter",
        _ => "unknown status",
    }
}

/// Completion codes (section 5.2), for messages.
pub fn completion(code: u8) -> &'static str {
    match code {
        0xc0 => "node busy",
        0xc1 => "invalid command",
        0xc2 => "command invalid for given lun",
        0xc3 => "timeout while processing command",
        0xc4 => "out of space",
        0xc5 => "reservation canceled or invalid",
        0xc6 => "request data truncated",
        0xc7 => "request data length invalid",
        0xc8 => "request data field length limit exceeded",
        0xc9 => "parameter out of range",
        0xcc => "invalid data field in request",
        0xcd => "command illegal for specified sensor or record type",
        0xce => "command response could not be provided",
        0xd4 => "insufficient privilege level",
        0xd5 => "command not supported in present state",
        0xd6 => "command sub-function disabled or unavailable",
        0xff => "unspecified error",
        _ => "unknown completion code",
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// The capture of tests/fixtures/ipmi/regen.sh: (user, password,
    /// datagrams with their direction, true = to the BMC).
    fn golden() -> (String, String, Vec<(bool, Vec<u8>)>) {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/ipmi/lanplus_bootdev_pxe_efi.txt"
        );
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("{path}: {e} (run tests/fixtures/ipmi/regen.sh)"));
        let (mut user, mut password, mut packets) = (String::new(), String::new(), Vec::new());
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (k, v) = line.split_once(' ').unwrap();
            match k {
                "user" => user = v.to_string(),
                "password" => password = v.to_string(),
                "c" | "b" => packets.push((k == "c", hex::decode(v).unwrap())),
                other => panic!("unknown line kind {other}"),
            }
        }
        (user, password, packets)
    }

    fn first<'a>(packets: &'a [(bool, Vec<u8>)], kind: PayloadType) -> Packet<'a> {
        packets
            .iter()
            .filter_map(|(_, p)| split(p).ok())
            .find(|p| p.payload_type & 0x3f == kind as u8)
            .unwrap_or_else(|| panic!("no {kind:?} in the capture"))
    }

    #[test]
    fn golden_ipmitool_session_verifies_and_our_encodings_match() {
        let (user, password, packets) = golden();
        // Open Session: ipmitool asks for suite 3 in our layout.
        let req = first(&packets, PayloadType::OpenSessionRequest);
        let console_sid = le32(&req.payload[4..8]);
        assert_eq!(
            req.payload,
            &open_session_request(req.payload[0], console_sid)[..]
        );
        assert_eq!(
            presession_packet(PayloadType::OpenSessionRequest, req.payload),
            packets.iter().find(|(c, p)| *c && p[5] == 0x10).unwrap().1
        );
        let resp =
            parse_open_session_response(first(&packets, PayloadType::OpenSessionResponse).payload)
                .unwrap();
        assert_eq!((resp.status, resp.console_sid), (0, console_sid));
        assert_eq!(resp.algorithms, CIPHER_SUITE_3);
        // RAKP 1: our encoding of its fields is its bytes.
        let r1 = first(&packets, PayloadType::Rakp1).payload;
        let mut console_random = [0u8; 16];
        console_random.copy_from_slice(&r1[8..24]);
        let role = r1[24];
        assert_eq!(role, ROLE_ADMIN_NAME_ONLY);
        assert_eq!(
            rakp1(r1[0], resp.bmc_sid, &console_random, role, user.as_bytes()),
            r1
        );
        let r2 = parse_rakp2(first(&packets, PayloadType::Rakp2).payload).unwrap();
        assert_eq!((r2.status, r2.console_sid), (0, console_sid));
        let hs = Handshake {
            console_sid,
            bmc_sid: resp.bmc_sid,
            console_random,
            bmc_random: r2.bmc_random,
            bmc_guid: r2.bmc_guid,
            role,
            user: user.as_bytes(),
            password: password.as_bytes(),
        };
        // RAKP 2's code is what we expect of a BMC knowing the password.
        assert_eq!(hs.rakp2_auth_code().as_slice(), r2.auth_code.as_slice());
        let wrong = Handshake {
            password: b"wrong",
            ..hs.clone()
        };
        assert_ne!(wrong.rakp2_auth_code().as_slice(), r2.auth_code.as_slice());
        // RAKP 3: ipmitool's message is ours.
        let r3 = first(&packets, PayloadType::Rakp3).payload;
        assert_eq!(rakp3(r3[0], resp.bmc_sid, &hs.rakp3_auth_code()), r3);
        // RAKP 4: the BMC's ICV verifies with our SIK.
        let keys = hs.keys();
        let r4 = parse_rakp4(first(&packets, PayloadType::Rakp4).payload).unwrap();
        assert_eq!(r4.status, 0);
        assert_eq!(hs.rakp4_icv(&keys.sik).as_slice(), r4.icv.as_slice());
        // Every session packet, both ways, verifies with K1 and decrypts
        // with K2; ipmitool's requests re-encode byte for byte.
        let mut boot_flags = None;
        let mut sessions = 0;
        // (netfn, command, first data byte) of each request, by sequence
        let mut asked = std::collections::HashMap::new();
        for (to_bmc, raw) in &packets {
            if raw[4] != AUTH_RMCPP {
                continue; // ipmitool's IPMI 1.5 Get Channel Auth Capabilities
            }
            let p = split(raw).unwrap();
            if p.sid == 0 {
                continue;
            }
            sessions += 1;
            assert_eq!(p.payload_type, 0xc0);
            let msg = open_session_packet(&keys, &p).unwrap();
            if *to_bmc {
                assert_eq!(p.sid, resp.bmc_sid);
                let (nf, cmd_, rq_seq) = (msg[1] >> 2, msg[5], msg[4] >> 2);
                let data = &msg[6..msg.len() - 1];
                assert_eq!(request(nf, cmd_, rq_seq, data), msg);
                let mut iv = [0u8; 16];
                iv.copy_from_slice(&p.payload[..16]);
                assert_eq!(&session_packet(&keys, p.sid, p.seq, &iv, &msg), raw);
                asked.insert(rq_seq, (nf, cmd_, data.first().copied()));
                if (nf, cmd_, data.first())
                    == (netfn::CHASSIS, cmd::SET_SYSTEM_BOOT_OPTIONS, Some(&5))
                {
                    boot_flags = Some(data.to_vec());
                }
            } else {
                assert_eq!(p.sid, console_sid);
                let r = parse_response(&msg).unwrap();
                let req = asked[&r.rq_seq];
                assert_eq!((req.0 + 1, req.1), (r.netfn, r.cmd), "{r:?}");
                match req {
                    // ipmitool probes group extensions ipmi_sim lacks (0xc1)
                    (0x2c, ..) => assert_eq!(r.completion, 0xc1, "{r:?}"),
                    // ipmi_sim refuses "set in progress" (parameter 0), which
                    // ipmitool tolerates: anneal never sends it
                    (netfn::CHASSIS, cmd::SET_SYSTEM_BOOT_OPTIONS, Some(0)) => {
                        assert_eq!(r.completion, 0xcc, "{r:?}")
                    }
                    _ => assert_eq!(r.completion, 0, "{req:02x?} {r:?}"),
                }
            }
        }
        assert!(sessions >= 4, "{sessions} session packets");
        // `bootdev pxe options=efiboot`: valid, one-time, EFI, PXE: ours.
        assert_eq!(
            boot_flags.as_deref(),
            Some(&boot_flags_once_efi(BootDevice::Pxe)[..])
        );
    }

    #[test]
    fn tampered_packets_are_refused() {
        let keys = Handshake {
            console_sid: 1,
            bmc_sid: 2,
            console_random: [3; 16],
            bmc_random: [4; 16],
            bmc_guid: [5; 16],
            role: ROLE_ADMIN_NAME_ONLY,
            user: b"admin",
            password: b"pw",
        }
        .keys();
        let msg = request(netfn::CHASSIS, cmd::GET_CHASSIS_STATUS, 1, &[]);
        let pkt = session_packet(&keys, 2, 1, &[9; 16], &msg);
        // the integrity-covered part is a multiple of 4
        assert_eq!((pkt.len() - 4 - AUTHCODE_LEN) % 4, 0);
        assert_eq!(
            open_session_packet(&keys, &split(&pkt).unwrap()).unwrap(),
            msg
        );
        let mut bad = pkt.clone();
        bad[20] ^= 1;
        assert_eq!(
            open_session_packet(&keys, &split(&bad).unwrap()),
            Err(WireError::Integrity)
        );
        assert!(split(&pkt[..10]).is_err());
        assert!(split(&pkt[..20]).is_err());
        let mut not_rmcp = pkt.clone();
        not_rmcp[4] = 0x00;
        assert!(matches!(split(&not_rmcp), Err(WireError::NotRmcpPlus(_))));
        // a response with a bad checksum
        let mut resp = vec![RQ_ADDR, 0x01 << 2];
        resp.push(checksum(&resp));
        resp.extend_from_slice(&[RS_ADDR, 1 << 2, cmd::GET_CHASSIS_STATUS, 0x00, 0x01, 0, 0]);
        let c = checksum(&resp[3..]);
        resp.push(c);
        let r = parse_response(&resp).unwrap();
        assert_eq!((r.completion, r.data.as_slice()), (0, &[1u8, 0, 0][..]));
        let n = resp.len();
        resp[n - 1] ^= 0xff;
        assert_eq!(parse_response(&resp), Err(WireError::Checksum));
        assert!(parse_rakp2(&[0, 0, 0]).is_err());
        assert_eq!(parse_rakp2(&[7, 0x0d]).unwrap().status, 0x0d);
        assert!(decrypt(&keys.k2, &[0; 17]).is_err());
    }

    /// The session keys of the capture, derived from its handshake.
    fn golden_keys(user: &str, password: &str, packets: &[(bool, Vec<u8>)]) -> Keys {
        let req = first(packets, PayloadType::OpenSessionRequest);
        let resp =
            parse_open_session_response(first(packets, PayloadType::OpenSessionResponse).payload)
                .unwrap();
        let r1 = first(packets, PayloadType::Rakp1).payload;
        let r2 = parse_rakp2(first(packets, PayloadType::Rakp2).payload).unwrap();
        let mut console_random = [0u8; 16];
        console_random.copy_from_slice(&r1[8..24]);
        Handshake {
            console_sid: le32(&req.payload[4..8]),
            bmc_sid: resp.bmc_sid,
            console_random,
            bmc_random: r2.bmc_random,
            bmc_guid: r2.bmc_guid,
            role: r1[24],
            user: user.as_bytes(),
            password: password.as_bytes(),
        }
        .keys()
    }

    /// Hostile variants of every datagram of the capture: each truncation
    /// and each single-byte flip of a session packet is refused (never a
    /// panic, never a message); the pre-session parsers never panic.
    #[test]
    fn truncated_and_flipped_capture_packets_are_refused() {
        let (user, password, packets) = golden();
        let keys = golden_keys(&user, &password, &packets);
        let open = |b: &[u8]| split(b).and_then(|p| open_session_packet(&keys, &p));
        let mut checked = 0;
        for (_, raw) in &packets {
            let Ok(p) = split(raw) else { continue };
            if p.sid == 0 {
                for n in 0..raw.len() {
                    if let Ok(q) = split(&raw[..n]) {
                        let _ = parse_open_session_response(q.payload);
                        let _ = parse_rakp2(q.payload);
                        let _ = parse_rakp4(q.payload);
                    }
                }
                continue;
            }
            let msg = open(raw).unwrap();
            let _ = parse_response(&msg);
            for n in 0..raw.len() {
                assert!(open(&raw[..n]).is_err(), "prefix of {n} bytes accepted");
            }
            for i in 0..raw.len() {
                let mut bad = raw.clone();
                bad[i] ^= 0x01;
                assert!(open(&bad).is_err(), "flip of byte {i} accepted");
            }
            // the decryption alone (behind the integrity check) on damage
            for i in 0..p.payload.len() {
                let mut bad = p.payload.to_vec();
                bad[i] ^= 0x80;
                let _ = decrypt(&keys.k2, &bad);
                let _ = decrypt(&keys.k2, &bad[..i]);
            }
            for n in 0..msg.len() {
                let _ = parse_response(&msg[..n]);
            }
            checked += 1;
        }
        assert!(checked >= 4, "{checked} session packets");
    }

    #[test]
    fn boot_flags_encode_valid_once_efi() {
        assert_eq!(
            boot_flags_once_efi(BootDevice::Pxe),
            [5, 0xa0, 0x04, 0, 0, 0]
        );
        assert_eq!(
            boot_flags_once_efi(BootDevice::Disk),
            [5, 0xa0, 0x08, 0, 0, 0]
        );
        assert_eq!(BOOT_FLAGS_CLEAR[1] & 0x80, 0);
    }
}
