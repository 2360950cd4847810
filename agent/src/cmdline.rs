//! The kernel command line: a typed parser for the boot parameters of docs/api.md.
//!
//! `anneal.api=<https URL>` `anneal.ca=<sha256 hex>` `anneal.token=<token>`
//! `anneal.machine=<namespace>/<name>` `BOOTIF=01-<mac with dashes>`
//! `console=…` `anneal.debug=shell` `anneal.ip=<addr/prefix>[,gateway]`
//! `anneal.lldp=<seconds>`.
//!
//! Words are split the way the kernel splits them (whitespace, double quotes
//! group, the quotes themselves are dropped); parsing stops at `--`. Every
//! `anneal.*` key may appear once: a repeated key is an error rather than
//! "last one wins", so a second token or API URL cannot be smuggled in.
//! Unknown `anneal.*` keys are kept as warnings for forward compatibility.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

use anneal_api::agent::Token;
use serde::Serialize;

/// The MAC type is anneal-api's (one type for the agent, bootd and the manager).
pub use anneal_api::Mac;

/// Longest command line accepted (the kernel's COMMAND_LINE_SIZE on x86 is 2048;
/// leave room for larger builds).
pub const MAX_CMDLINE: usize = 16 * 1024;

/// A malformed boot parameter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmdlineError {
    /// The command line is longer than [`MAX_CMDLINE`].
    #[error("command line is {0} bytes, more than the {MAX_CMDLINE} accepted")]
    TooLong(usize),
    /// A parameter given twice.
    #[error("{0} is given more than once")]
    Duplicate(&'static str),
    /// A parameter whose value does not parse.
    #[error("{key}: {reason}")]
    Invalid {
        /// The parameter.
        key: &'static str,
        /// What is wrong with it (never contains a secret).
        reason: String,
    },
}

fn invalid(key: &'static str, reason: impl Into<String>) -> CmdlineError {
    CmdlineError::Invalid {
        key,
        reason: reason.into(),
    }
}

/// A host in a URL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "value", rename_all = "lowercase")]
pub enum Host {
    /// A DNS name (lowercase).
    Name(String),
    /// An IPv4 literal.
    Ipv4(Ipv4Addr),
    /// An IPv6 literal (written in brackets in the URL).
    Ipv6(Ipv6Addr),
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ipv4(a) => write!(f, "{a}"),
            Host::Ipv6(a) => write!(f, "[{a}]"),
        }
    }
}

/// The manager's agent API: always `https`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiUrl {
    /// Host to connect to and to verify in the certificate.
    pub host: Host,
    /// TCP port (443 when not given).
    pub port: u16,
    /// Path prefix without a trailing slash (`""` for the root).
    pub base_path: String,
}

impl ApiUrl {
    /// Parses `https://host[:port][/path]`.
    pub fn parse(s: &str) -> Result<Self, CmdlineError> {
        const KEY: &str = "anneal.api";
        let rest = match s.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("https") => rest,
            Some((scheme, _)) => {
                return Err(invalid(
                    KEY,
                    format!("scheme {scheme:?} is not https (the agent API is HTTPS only)"),
                ));
            }
            None => {
                return Err(invalid(
                    KEY,
                    "not a URL (expected https://host[:port][/path])",
                ));
            }
        };
        if rest.contains(['?', '#']) {
            return Err(invalid(KEY, "query strings and fragments are not allowed"));
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.contains('@') {
            return Err(invalid(KEY, "user information is not allowed in the URL"));
        }
        let (host, port) = if let Some(after) = authority.strip_prefix('[') {
            let (lit, tail) = after
                .split_once(']')
                .ok_or_else(|| invalid(KEY, "unterminated IPv6 literal"))?;
            let addr: Ipv6Addr = lit
                .parse()
                .map_err(|_| invalid(KEY, format!("bad IPv6 literal {lit:?}")))?;
            let port = match tail {
                "" => None,
                t => Some(
                    t.strip_prefix(':')
                        .ok_or_else(|| invalid(KEY, "junk after IPv6 literal"))?,
                ),
            };
            (Host::Ipv6(addr), port)
        } else {
            let (h, p) = match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            };
            (parse_host(h)?, p)
        };
        let port = match port {
            None => 443,
            Some(p) => match p.parse::<u16>() {
                Ok(0) | Err(_) => return Err(invalid(KEY, format!("bad port {p:?}"))),
                Ok(n) => n,
            },
        };
        let base_path = path.trim_end_matches('/').to_string();
        if base_path.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err(invalid(
                KEY,
                "path has characters that are not printable ASCII",
            ));
        }
        if base_path.split('/').any(|seg| seg == ".." || seg == ".") {
            return Err(invalid(KEY, "path has dot segments"));
        }
        Ok(Self {
            host,
            port,
            base_path,
        })
    }

    /// The full path of an API endpoint, e.g. `/v1/agent/register`.
    pub fn path(&self, endpoint: &str) -> String {
        format!("{}{}", self.base_path, endpoint)
    }

    /// The name the server certificate must carry (DNS name or IP).
    pub fn server_name(&self) -> String {
        match &self.host {
            Host::Name(n) => n.clone(),
            Host::Ipv4(a) => a.to_string(),
            Host::Ipv6(a) => a.to_string(),
        }
    }

    /// `host:port` for connecting (IPv6 in brackets).
    pub fn authority(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

impl fmt::Display for ApiUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "https://{}:{}{}", self.host, self.port, self.base_path)
    }
}

fn parse_host(h: &str) -> Result<Host, CmdlineError> {
    const KEY: &str = "anneal.api";
    if h.is_empty() {
        return Err(invalid(KEY, "empty host"));
    }
    if h.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return h
            .parse::<Ipv4Addr>()
            .map(Host::Ipv4)
            .map_err(|_| invalid(KEY, format!("bad IPv4 address {h:?}")));
    }
    let name = h.to_ascii_lowercase();
    let valid = name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if !valid {
        return Err(invalid(KEY, format!("bad host name {h:?}")));
    }
    Ok(Host::Name(name))
}

/// The SHA-256 of the agent API's CA certificate (DER).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CaPin(pub [u8; 32]);

impl CaPin {
    /// Parses 64 hex digits, optionally separated by colons
    /// (`openssl x509 -fingerprint -sha256` style) and optionally prefixed
    /// with `sha256:`.
    pub fn parse(s: &str) -> Result<Self, CmdlineError> {
        const KEY: &str = "anneal.ca";
        let s = s.strip_prefix("sha256:").unwrap_or(s);
        let hexdigits: String = if s.contains(':') {
            let parts: Vec<&str> = s.split(':').collect();
            if parts.len() != 32 || parts.iter().any(|p| p.len() != 2) {
                return Err(invalid(KEY, "colon form must be 32 pairs of hex digits"));
            }
            parts.concat()
        } else {
            s.to_string()
        };
        if hexdigits.len() != 64 {
            return Err(invalid(
                KEY,
                format!(
                    "expected 64 hex digits of a SHA-256, got {} characters",
                    hexdigits.len()
                ),
            ));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(&hexdigits, &mut out).map_err(|_| invalid(KEY, "not hexadecimal"))?;
        Ok(Self(out))
    }

    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for CaPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CaPin({})", self.to_hex())
    }
}

impl Serialize for CaPin {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

fn parse_bootif(s: &str) -> Result<Mac, CmdlineError> {
    const KEY: &str = "BOOTIF";
    // pxelinux/iPXE form: "01-" (ARP hardware type 1, Ethernet) then the MAC.
    let (htype, mac) = s
        .split_once('-')
        .ok_or_else(|| invalid(KEY, "expected 01-aa-bb-cc-dd-ee-ff"))?;
    if htype != "01" {
        return Err(invalid(
            KEY,
            format!("hardware type {htype:?} is not 01 (Ethernet)"),
        ));
    }
    mac.parse()
        .map_err(|_| invalid(KEY, "expected 01-aa-bb-cc-dd-ee-ff"))
}

/// `namespace/name` of the Machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MachineName {
    /// Namespace (a DNS-1123 label).
    pub namespace: String,
    /// Name (a DNS-1123 subdomain).
    pub name: String,
}

impl fmt::Display for MachineName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

fn dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn parse_machine(s: &str) -> Result<MachineName, CmdlineError> {
    const KEY: &str = "anneal.machine";
    let (ns, name) = s
        .split_once('/')
        .ok_or_else(|| invalid(KEY, "expected <namespace>/<name>"))?;
    if !dns1123_label(ns) {
        return Err(invalid(
            KEY,
            format!("namespace {ns:?} is not a DNS-1123 label"),
        ));
    }
    if name.len() > 253 || !name.split('.').all(dns1123_label) {
        return Err(invalid(
            KEY,
            format!("name {name:?} is not a DNS-1123 subdomain"),
        ));
    }
    Ok(MachineName {
        namespace: ns.to_string(),
        name: name.to_string(),
    })
}

/// Static IPv4 configuration from `anneal.ip=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StaticIp {
    /// The address.
    pub address: Ipv4Addr,
    /// Prefix length (0..=32).
    pub prefix: u8,
    /// Default gateway, when given.
    pub gateway: Option<Ipv4Addr>,
}

fn parse_static_ip(s: &str) -> Result<StaticIp, CmdlineError> {
    const KEY: &str = "anneal.ip";
    let (cidr, gw) = match s.split_once(',') {
        Some((c, g)) => (c, Some(g)),
        None => (s, None),
    };
    let (addr, prefix) = cidr
        .split_once('/')
        .ok_or_else(|| invalid(KEY, "expected <addr>/<prefix>[,<gateway>]"))?;
    let address: Ipv4Addr = addr
        .parse()
        .map_err(|_| invalid(KEY, format!("bad IPv4 address {addr:?}")))?;
    let prefix: u8 = match prefix.parse() {
        Ok(p) if p <= 32 && !prefix.starts_with('+') => p,
        _ => return Err(invalid(KEY, format!("bad prefix length {prefix:?}"))),
    };
    if address.is_unspecified() || address.is_broadcast() || address.is_multicast() {
        return Err(invalid(KEY, format!("{address} is not a host address")));
    }
    let gateway = match gw {
        None | Some("") => None,
        Some(g) => {
            let g: Ipv4Addr = g
                .parse()
                .map_err(|_| invalid(KEY, format!("bad gateway {g:?}")))?;
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix))
            };
            if u32::from(g) & mask != u32::from(address) & mask {
                return Err(invalid(
                    KEY,
                    format!("gateway {g} is outside {address}/{prefix}"),
                ));
            }
            Some(g)
        }
    };
    Ok(StaticIp {
        address,
        prefix,
        gateway,
    })
}

/// The longest LLDP window `anneal.lldp` may ask for, in seconds.
pub const MAX_LLDP_SECS: u32 = 120;

/// `anneal.lldp=<seconds>`: a whole number of seconds up to
/// [`MAX_LLDP_SECS`].
fn parse_lldp_wait(s: &str) -> Result<u32, CmdlineError> {
    match s.parse::<u32>() {
        Ok(n) if n <= MAX_LLDP_SECS => Ok(n),
        _ => Err(invalid(
            "anneal.lldp",
            format!("not a whole number of seconds from 0 to {MAX_LLDP_SECS}"),
        )),
    }
}

/// What to do when something fails.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DebugMode {
    /// Report, retry, reboot after a delay.
    #[default]
    Off,
    /// Spawn a shell on the console.
    Shell,
}

const TOKEN_MIN: usize = 16;
const TOKEN_MAX: usize = 512;

fn parse_token(s: &str) -> Result<Token, CmdlineError> {
    const KEY: &str = "anneal.token";
    // Never echo any part of the value.
    if s.len() < TOKEN_MIN || s.len() > TOKEN_MAX {
        return Err(invalid(
            KEY,
            format!(
                "length {} is outside {TOKEN_MIN}..={TOKEN_MAX} characters",
                s.len()
            ),
        ));
    }
    if !s.bytes().all(|b| {
        b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'+' | b'/' | b'=')
    }) {
        return Err(invalid(
            KEY,
            "has characters outside the base64/base64url/hex alphabet",
        ));
    }
    Ok(Token::new(s))
}

/// Where bootd's per-boot token cpio (the iPXE script's second initrd)
/// puts the boot token (docs/api.md, "Boot parameters"). It wins over
/// `anneal.token=`, which stays accepted for labs.
pub const TOKEN_FILE: &str = "/run/anneal/token";

/// The boot token of the file at `path`: `Ok(None)` when there is no such
/// file; surrounding whitespace is ignored. An unreadable or malformed
/// file is an error that never echoes its content.
pub fn read_token_file(path: &std::path::Path) -> Result<Option<Token>, CmdlineError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => zeroize::Zeroizing::new(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(invalid(
                "anneal.token",
                format!("the token file {} is unreadable: {e}", path.display()),
            ));
        }
    };
    let Ok(text) = std::str::from_utf8(&bytes) else {
        return Err(invalid(
            "anneal.token",
            format!("the token file {} is not UTF-8", path.display()),
        ));
    };
    parse_token(text.trim()).map(Some)
}

/// The typed boot parameters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BootParams {
    /// `anneal.api`.
    pub api: Option<ApiUrl>,
    /// `anneal.ca`.
    pub ca: Option<CaPin>,
    /// `anneal.token` (redacted in `Debug`).
    pub token: Option<Token>,
    /// `anneal.machine`.
    pub machine: Option<MachineName>,
    /// `BOOTIF`.
    pub bootif: Option<Mac>,
    /// Every `console=` value in order (the last is the primary console).
    pub consoles: Vec<String>,
    /// `anneal.debug`.
    pub debug: DebugMode,
    /// `anneal.ip`.
    pub ip: Option<StaticIp>,
    /// `anneal.lldp`: seconds the inspection listens for LLDP (0: off).
    pub lldp: Option<u32>,
    /// `anneal.*` keys this agent does not know (kept for a warning line).
    pub unknown: Vec<String>,
}

/// What the agent needs to register, all present.
#[derive(Debug, Clone)]
pub struct RegistrationParams {
    /// The API URL.
    pub api: ApiUrl,
    /// The CA pin.
    pub ca: CaPin,
    /// The boot token.
    pub token: Token,
}

/// Splits a command line into words the way the kernel's `next_arg` does.
pub fn split_words(cmdline: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_quote = false;
    let mut has_word = false;
    for c in cmdline.chars() {
        if c == '"' {
            in_quote = !in_quote;
            has_word = true;
            continue;
        }
        if c.is_ascii_whitespace() && !in_quote {
            if has_word {
                words.push(std::mem::take(&mut cur));
                has_word = false;
            }
            continue;
        }
        cur.push(c);
        has_word = true;
    }
    if has_word {
        words.push(cur);
    }
    words
}

impl BootParams {
    /// Parses `/proc/cmdline` contents.
    pub fn parse(raw: &[u8]) -> Result<Self, CmdlineError> {
        if raw.len() > MAX_CMDLINE {
            return Err(CmdlineError::TooLong(raw.len()));
        }
        let text = String::from_utf8_lossy(raw);
        let mut p = BootParams::default();
        let mut unknown = Vec::new();
        for word in split_words(&text) {
            if word == "--" {
                break;
            }
            let (key, value) = match word.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (word.as_str(), None),
            };
            match key {
                "anneal.api" => {
                    let v = need_value("anneal.api", value)?;
                    set_once(&mut p.api, "anneal.api", ApiUrl::parse(v)?)?;
                }
                "anneal.ca" => {
                    let v = need_value("anneal.ca", value)?;
                    set_once(&mut p.ca, "anneal.ca", CaPin::parse(v)?)?;
                }
                "anneal.token" => {
                    let v = need_value("anneal.token", value)?;
                    set_once(&mut p.token, "anneal.token", parse_token(v)?)?;
                }
                "anneal.machine" => {
                    let v = need_value("anneal.machine", value)?;
                    set_once(&mut p.machine, "anneal.machine", parse_machine(v)?)?;
                }
                "BOOTIF" => {
                    let v = need_value("BOOTIF", value)?;
                    set_once(&mut p.bootif, "BOOTIF", parse_bootif(v)?)?;
                }
                "anneal.ip" => {
                    let v = need_value("anneal.ip", value)?;
                    set_once(&mut p.ip, "anneal.ip", parse_static_ip(v)?)?;
                }
                "anneal.lldp" => {
                    let v = need_value("anneal.lldp", value)?;
                    set_once(&mut p.lldp, "anneal.lldp", parse_lldp_wait(v)?)?;
                }
                "anneal.debug" => {
                    let v = need_value("anneal.debug", value)?;
                    if p.debug != DebugMode::Off {
                        return Err(CmdlineError::Duplicate("anneal.debug"));
                    }
                    p.debug = match v {
                        "shell" => DebugMode::Shell,
                        "off" | "0" | "" => DebugMode::Off,
                        other => {
                            return Err(invalid(
                                "anneal.debug",
                                format!("unknown mode {other:?} (expected shell)"),
                            ));
                        }
                    };
                }
                "console" => {
                    if let Some(v) = value
                        && !v.is_empty()
                        && p.consoles.len() < 16
                    {
                        p.consoles.push(v.to_string());
                    }
                }
                k if k.starts_with("anneal.") => {
                    // Keep the key only: the value could be anything.
                    unknown.push(k.to_string());
                }
                _ => {}
            }
        }
        // Made printable once the token (which may come later) is known.
        for k in unknown {
            let k = printable_key(&k, p.token.as_ref());
            if !p.unknown.contains(&k) && p.unknown.len() < 32 {
                p.unknown.push(k);
            }
        }
        Ok(p)
    }

    /// The parameters registration needs, or which one is missing.
    pub fn registration(&self) -> Result<RegistrationParams, CmdlineError> {
        let missing = |key: &'static str| invalid(key, "missing from the kernel command line");
        let no_token = || {
            invalid(
                "anneal.token",
                format!(
                    "missing: no {TOKEN_FILE} (bootd's token cpio) and no anneal.token on the kernel command line"
                ),
            )
        };
        Ok(RegistrationParams {
            api: self.api.clone().ok_or_else(|| missing("anneal.api"))?,
            ca: self.ca.ok_or_else(|| missing("anneal.ca"))?,
            token: self.token.clone().ok_or_else(no_token)?,
        })
    }

    /// A JSON view with the token replaced by its length (for golden vectors
    /// and `anneal-agent cmdline`). The token's text is also scrubbed from
    /// every other value (a command line may repeat it, e.g. in a
    /// `console=` value or a URL path).
    pub fn redacted_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "api": self.api.as_ref().map(|a| serde_json::json!({
                "url": a.to_string(),
                "host": a.host,
                "port": a.port,
                "basePath": a.base_path,
            })),
            "ca": self.ca,
            "token": self.token.as_ref().map(|t| format!("<redacted {} bytes>", t.len())),
            "machine": self.machine.as_ref().map(ToString::to_string),
            "bootif": self.bootif,
            "consoles": self.consoles,
            "debug": self.debug,
            "ip": self.ip,
            "lldp": self.lldp,
            "unknown": self.unknown,
        });
        if let Some(t) = &self.token {
            scrub(&mut v, t.expose());
        }
        v
    }
}

/// Replaces every occurrence of `secret` in the strings of `v`.
fn scrub(v: &mut serde_json::Value, secret: &str) {
    match v {
        serde_json::Value::String(s) if !secret.is_empty() && s.contains(secret) => {
            *s = s.replace(secret, "<redacted>");
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(|x| scrub(x, secret)),
        serde_json::Value::Object(o) => o.values_mut().for_each(|x| scrub(x, secret)),
        _ => {}
    }
}

/// An unknown `anneal.*` key as it may be printed. A key can carry the boot
/// token when a `=` is missing or mistyped (`anneal.token:SECRET`, or the
/// token run into another word): such a key is redacted; any other is cut
/// at 64 characters.
fn printable_key(key: &str, token: Option<&Token>) -> String {
    if key.starts_with("anneal.token") {
        "anneal.token<redacted>".into()
    } else if token.is_some_and(|t| !t.expose().is_empty() && key.contains(t.expose())) {
        "anneal.<redacted: holds the boot token>".into()
    } else {
        key.chars().take(64).collect()
    }
}

fn need_value<'a>(key: &'static str, v: Option<&'a str>) -> Result<&'a str, CmdlineError> {
    v.ok_or_else(|| invalid(key, "has no value"))
}

fn set_once<T>(slot: &mut Option<T>, key: &'static str, v: T) -> Result<(), CmdlineError> {
    if slot.is_some() {
        return Err(CmdlineError::Duplicate(key));
    }
    *slot = Some(v);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PIN: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    #[test]
    fn full_line_parses() {
        let line = format!(
            "initrd=initrd.zst console=tty0 console=ttyS0,115200n8 anneal.api=https://10.77.0.1:8443/ \
             anneal.ca={PIN} anneal.token=AAAAbbbbCCCCdddd0123456789_- anneal.machine=lab/node-1 \
             BOOTIF=01-52-54-00-AB-cd-EF anneal.debug=shell anneal.ip=10.77.0.50/24,10.77.0.1 quiet\n"
        );
        let p = BootParams::parse(line.as_bytes()).unwrap();
        let api = p.api.as_ref().unwrap();
        assert_eq!(api.host, Host::Ipv4(Ipv4Addr::new(10, 77, 0, 1)));
        assert_eq!(api.port, 8443);
        assert_eq!(api.path("/v1/agent/next"), "/v1/agent/next");
        assert_eq!(p.ca.unwrap().to_hex(), PIN);
        assert_eq!(
            p.token.as_ref().unwrap().expose(),
            "AAAAbbbbCCCCdddd0123456789_-"
        );
        assert_eq!(p.machine.as_ref().unwrap().to_string(), "lab/node-1");
        assert_eq!(p.bootif.unwrap().to_string(), "52:54:00:ab:cd:ef");
        assert_eq!(p.consoles, ["tty0", "ttyS0,115200n8"]);
        assert_eq!(p.debug, DebugMode::Shell);
        assert_eq!(
            p.ip,
            Some(StaticIp {
                address: Ipv4Addr::new(10, 77, 0, 50),
                prefix: 24,
                gateway: Some(Ipv4Addr::new(10, 77, 0, 1))
            })
        );
        assert!(!format!("{p:?}").contains("AAAAbbbb"));
        assert!(!p.redacted_json().to_string().contains("AAAAbbbb"));
        assert!(p.registration().is_ok());
    }

    #[test]
    fn quotes_and_double_dash() {
        assert_eq!(
            split_words(r#"a="b c" "d e"=f  g"#),
            ["a=b c", "d e=f", "g"]
        );
        let p = BootParams::parse(b"console=ttyS0 -- anneal.debug=shell").unwrap();
        assert_eq!(p.debug, DebugMode::Off);
    }

    #[test]
    fn duplicates_are_errors() {
        let line = format!("anneal.ca={PIN} anneal.ca={PIN}");
        assert_eq!(
            BootParams::parse(line.as_bytes()),
            Err(CmdlineError::Duplicate("anneal.ca"))
        );
    }

    #[test]
    fn hostile_values_are_refused_without_echoing_tokens() {
        for bad in [
            "anneal.api=http://10.0.0.1/",
            "anneal.api=https://user:pw@host/",
            "anneal.api=https://host:0/",
            "anneal.api=https://host:99999/",
            "anneal.api=https://[::1/",
            "anneal.api=https://-bad-.example/",
            "anneal.api=https://host/a/../b",
            "anneal.api=https://host/?q=1",
            "anneal.api=https://999.1.1.1/",
            "anneal.ca=abc",
            "anneal.ca=zz86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
            "anneal.machine=noslash",
            "anneal.machine=UPPER/x",
            "anneal.machine=ns/a..b",
            "BOOTIF=52-54-00-12-34-56",
            "BOOTIF=06-52-54-00-12-34-56",
            "BOOTIF=01-52-54-00-12-34",
            "anneal.ip=10.0.0.1",
            "anneal.ip=10.0.0.1/33",
            "anneal.ip=10.0.0.1/24,10.0.1.1",
            "anneal.ip=0.0.0.0/0",
            "anneal.debug=rootkit",
            "anneal.api",
        ] {
            assert!(BootParams::parse(bad.as_bytes()).is_err(), "{bad} accepted");
        }
        let secret = "s3cr3t!s3cr3t!s3cr3t!";
        let err = BootParams::parse(format!("anneal.token={secret}").as_bytes()).unwrap_err();
        assert!(!err.to_string().contains("s3cr3t"), "{err}");
        assert!(BootParams::parse(&vec![b'a'; MAX_CMDLINE + 1]).is_err());
    }

    #[test]
    fn unknown_keys_never_carry_the_token() {
        // Found by the agent_cmdline fuzz target: the token's text inside
        // an unknown key (a `=` missing) reached the warning list.
        let tok = "Zm9vYmFyYmF6cXV4MDEyMzQ1Njc4OWFiY2RlZg";
        let line = format!(
            "anneal.apianneal.token1{tok} anneal.token={tok} anneal.tokn=x anneal.token:{tok}"
        );
        let p = BootParams::parse(line.as_bytes()).unwrap();
        assert_eq!(
            p.unknown,
            [
                "anneal.<redacted: holds the boot token>",
                "anneal.tokn",
                "anneal.token<redacted>"
            ]
        );
        assert!(!p.redacted_json().to_string().contains(&tok[..8]));
        // Without a valid anneal.token, a mistyped one is still hidden.
        let p = BootParams::parse(format!("anneal.token:{tok}").as_bytes()).unwrap();
        assert_eq!(p.unknown, ["anneal.token<redacted>"]);
        // The token's text repeated in another value is scrubbed from the view.
        let line = format!("console=ttyS0,{tok} anneal.token={tok}");
        let p = BootParams::parse(line.as_bytes()).unwrap();
        assert_eq!(p.redacted_json()["consoles"][0], "ttyS0,<redacted>");
        let long = format!("anneal.{}", "x".repeat(100));
        let p = BootParams::parse(long.as_bytes()).unwrap();
        assert_eq!(p.unknown[0].chars().count(), 64);
    }

    #[test]
    fn token_file_is_read_trimmed_and_never_echoed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        assert!(read_token_file(&path).unwrap().is_none(), "no file: none");
        let tok = "0123456789abcdef".repeat(4);
        std::fs::write(&path, format!("{tok}\n")).unwrap();
        assert_eq!(read_token_file(&path).unwrap().unwrap().expose(), tok);
        let secret = "s3cr3t s3cr3t s3cr3t s3cr3t";
        std::fs::write(&path, secret).unwrap();
        let err = read_token_file(&path).unwrap_err();
        assert!(!err.to_string().contains("s3cr3t"), "{err}");
        // without a token anywhere the error names both places
        let p = BootParams::parse(
            format!(
                "anneal.api=https://10.0.0.1:8443 anneal.ca={}",
                "ab".repeat(32)
            )
            .as_bytes(),
        )
        .unwrap();
        let err = p.registration().unwrap_err().to_string();
        assert!(
            err.contains(TOKEN_FILE) && err.contains("anneal.token"),
            "{err}"
        );
    }

    #[test]
    fn missing_registration_params_are_named() {
        let p = BootParams::parse(b"console=ttyS0").unwrap();
        let err = p.registration().unwrap_err();
        assert_eq!(
            err.to_string(),
            "anneal.api: missing from the kernel command line"
        );
    }

    #[test]
    fn ca_pin_forms() {
        let colon = PIN
            .as_bytes()
            .chunks(2)
            .map(|c| std::str::from_utf8(c).unwrap().to_ascii_uppercase())
            .collect::<Vec<_>>()
            .join(":");
        assert_eq!(CaPin::parse(&colon).unwrap().to_hex(), PIN);
        assert_eq!(
            CaPin::parse(&format!("sha256:{PIN}")).unwrap().to_hex(),
            PIN
        );
    }
}
