//! iPXE script rendering: a template with `{{name}}` placeholders, every one
//! of which must be replaced; a leftover placeholder is an error and the
//! script is never sent.

use std::collections::BTreeMap;

use anneal_dhcp::Mac;

use crate::config::{arch_name, boot_prefix};
use crate::state::{MachineBoot, Snapshot, Token};

/// The boot script template shipped in `ipxe/`.
pub const BOOT_TEMPLATE: &str = include_str!("../../ipxe/boot.ipxe.tmpl");
/// The script for a MAC no Machine enrolls.
pub const UNKNOWN_TEMPLATE: &str = include_str!("../../ipxe/unknown.ipxe.tmpl");
/// Prelude that chains `undionly.kpxe` from a NIC ROM iPXE.
pub const UNDIONLY_PRELUDE: &str = include_str!("../../ipxe/undionly-chain.ipxe.tmpl");
/// The TFTP `grub/grub.cfg` for network GRUB (loaded by the signed shim).
pub const GRUB_CFG_TEMPLATE: &str = include_str!("../../grub/grub.cfg.tmpl");
/// The per-machine GRUB config.
pub const GRUB_BOOT_TEMPLATE: &str = include_str!("../../grub/boot.grub.tmpl");
/// The GRUB config for a MAC no Machine enrolls.
pub const GRUB_UNKNOWN_TEMPLATE: &str = include_str!("../../grub/unknown.grub.tmpl");
/// Where network GRUB looks for its first config over TFTP (its prefix is
/// `/grub`).
pub const GRUB_CFG_PATH: &str = "grub/grub.cfg";

/// Name of the per-boot token cpio in the iPXE script (its second initrd).
pub const TOKEN_INITRD_NAME: &str = "anneal-token.cpio";
/// Where the token cpio puts the boot token (docs/api.md).
pub const TOKEN_PATH: &str = "run/anneal/token";

/// The URL path of `mac`'s token cpio.
pub fn token_path(mac: Mac) -> String {
    format!("/token/{}", mac.dashed())
}

/// The per-boot token cpio: a newc archive holding only the token at
/// `/run/anneal/token` (mode 0600, in a 0700 directory).
pub fn token_cpio(token: &Token) -> Result<Vec<u8>, anneal_cpio::Error> {
    let mut a = anneal_cpio::Archive::new();
    a.dir("run", 0o755)?;
    a.dir("run/anneal", 0o700)?;
    a.file(TOKEN_PATH, 0o600, token.expose().as_bytes().to_vec())?;
    Ok(a.to_bytes())
}

/// Errors of rendering a script.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScriptError {
    #[error("template placeholder {{{{{0}}}}} has no value")]
    Unreplaced(String),
    #[error("template has an unterminated placeholder")]
    Unterminated,
    #[error("kernel argument {0:?} contains whitespace or quotes")]
    BadArgument(String),
    #[error("no kernel and initrd are configured")]
    NoArtifacts,
    /// The machine's `spec.architecture` has no kernel and initramfs here.
    #[error(
        "no {0} kernel and initrd are configured (artifacts.{0} in the configuration, or {0}/ in --boot-dir)"
    )]
    NoArtifactsFor(&'static str),
}

/// Replaces every `{{key}}`; values are not rescanned.
pub fn render(template: &str, values: &BTreeMap<&str, String>) -> Result<String, ScriptError> {
    let mut out = String::with_capacity(template.len() + 256);
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find("}}").ok_or(ScriptError::Unterminated)?;
        let key = after[..end].trim();
        let v = values
            .get(key)
            .ok_or_else(|| ScriptError::Unreplaced(key.to_owned()))?;
        out.push_str(v);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

fn arg(k: &str, v: &str) -> Result<String, ScriptError> {
    if v.is_empty()
        || v.chars()
            .any(|c| c.is_whitespace() || c == '"' || c == '\'')
    {
        return Err(ScriptError::BadArgument(k.to_owned()));
    }
    Ok(format!("{k}={v}"))
}

/// The kernel command line of docs/api.md (without `initrd=`, which the
/// template adds, and without the boot token, which the token cpio carries).
pub fn cmdline(snap: &Snapshot, mac: Mac, m: &MachineBoot) -> Result<String, ScriptError> {
    let mut parts = Vec::new();
    if !snap.api.url.is_empty() {
        parts.push(arg("anneal.api", &snap.api.url)?);
    }
    if !snap.api.ca_sha256.is_empty() {
        parts.push(arg("anneal.ca", &snap.api.ca_sha256)?);
    }
    // The boot token is never on the command line (docs/api.md, "Boot
    // parameters"): it travels in the token cpio (see `boot_script`).
    parts.push(arg("anneal.machine", &m.name)?);
    parts.push(format!("BOOTIF={}", mac.bootif()));
    for c in &m.console {
        parts.push(arg("console", c)?);
    }
    if m.debug_shell {
        parts.push("anneal.debug=shell".into());
    }
    Ok(parts.join(" "))
}

/// The script for an enrolled machine.
pub fn boot_script(
    template: &str,
    snap: &Snapshot,
    mac: Mac,
    m: &MachineBoot,
) -> Result<String, ScriptError> {
    boot_script_at(template, snap, &snap.table.http_base, mac, m)
}

/// [`boot_script`] with its URLs under `http_base` (bootd's IPv6 address
/// for a machine that fetched it over IPv6).
pub fn boot_script_at(
    template: &str,
    snap: &Snapshot,
    http_base: &str,
    mac: Mac,
    m: &MachineBoot,
) -> Result<String, ScriptError> {
    let art = snap.artifacts.as_ref().ok_or(ScriptError::NoArtifacts)?;
    if art.for_arch(m.architecture).is_none() {
        return Err(ScriptError::NoArtifactsFor(arch_name(m.architecture)));
    }
    let boot = boot_prefix(m.architecture);
    let base = http_base.trim_end_matches('/');
    let server = snap.table.server_ip.to_string();
    let prelude = if m.chain_undionly {
        let mut v = BTreeMap::new();
        v.insert("server", server.clone());
        v.insert("undionly", snap.table.boot_files.bios.clone());
        render(UNDIONLY_PRELUDE, &v)?
    } else {
        String::new()
    };
    let mut v = BTreeMap::new();
    v.insert("machine", m.name.clone());
    v.insert("mac", mac.to_string());
    v.insert("server", server);
    v.insert("prelude", prelude);
    v.insert("initrd_name", art.initrd_name.clone());
    v.insert("initrd_url", format!("{base}/{boot}initrd"));
    v.insert("kernel_url", format!("{base}/{boot}kernel"));
    v.insert(
        "token_initrd",
        if m.token.unused().is_some() {
            format!(
                "initrd --name {TOKEN_INITRD_NAME} {base}{} || goto failed\n",
                token_path(mac)
            )
        } else {
            String::new()
        },
    );
    // the EFI stub loads the initrds named here, in this order
    v.insert(
        "initrd_args",
        if m.token.unused().is_some() {
            format!("initrd={TOKEN_INITRD_NAME} initrd={}", art.initrd_name)
        } else {
            format!("initrd={}", art.initrd_name)
        },
    );
    v.insert("cmdline", cmdline(snap, mac, m)?);
    render(template, &v)
}

/// The TFTP `grub/grub.cfg`: the same for every machine, it loads the
/// machine's own config, `grub/<mac>`, over TFTP too (Debian's signed network
/// GRUB has no http module, and under Secure Boot it loads none).
pub fn grub_cfg() -> Result<String, ScriptError> {
    render(GRUB_CFG_TEMPLATE, &BTreeMap::new())
}

/// The TFTP path of a machine's GRUB config, `grub/<mac>` (GRUB's
/// `${net_default_mac}`, colon-separated), parsed.
pub fn grub_config_mac(path: &str) -> Option<Mac> {
    path.strip_prefix("grub/")?.parse().ok()
}

/// The MAC of a token cpio path, `token/<mac>` (TFTP, for network GRUB).
pub fn token_path_mac(path: &str) -> Option<Mac> {
    path.strip_prefix("token/")?.parse().ok()
}

/// A machine's GRUB config, `grub/<mac>` over TFTP: for an enrolled machine
/// the kernel and command line of the iPXE script, then its token cpio
/// (`token/<mac>`, while the token is unused, first as in the iPXE script)
/// and the initramfs; for any other MAC a config that says why and exits.
pub fn grub_config(snap: &Snapshot, mac: Mac) -> Result<String, ScriptError> {
    let enrolled = snap.table.machines.contains_key(&mac);
    let Some(m) = snap.machines.get(&mac).filter(|_| enrolled) else {
        let mut v = BTreeMap::new();
        v.insert("mac", mac.to_string());
        return render(GRUB_UNKNOWN_TEMPLATE, &v);
    };
    let art = snap.artifacts.as_ref().ok_or(ScriptError::NoArtifacts)?;
    if art.for_arch(m.architecture).is_none() {
        return Err(ScriptError::NoArtifactsFor(arch_name(m.architecture)));
    }
    let boot = boot_prefix(m.architecture);
    let mut initrds = Vec::new();
    if m.token.unused().is_some() {
        initrds.push(token_path(mac));
    }
    initrds.push(format!("/{boot}initrd"));
    let mut v = BTreeMap::new();
    v.insert("machine", m.name.clone());
    v.insert("mac", mac.to_string());
    v.insert("server", snap.table.server_ip.to_string());
    v.insert("kernel_url", format!("/{boot}kernel"));
    v.insert("initrd_urls", initrds.join(" "));
    v.insert("cmdline", cmdline(snap, mac, m)?);
    render(GRUB_BOOT_TEMPLATE, &v)
}

/// The script for an unknown MAC: says why on the console, then `exit`s.
pub fn unknown_script(mac: Mac) -> Result<String, ScriptError> {
    let mut v = BTreeMap::new();
    v.insert("mac", mac.to_string());
    render(UNKNOWN_TEMPLATE, &v)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn leftover_placeholder_is_an_error() {
        let mut v = BTreeMap::new();
        v.insert("a", "1".to_string());
        assert_eq!(render("x {{a}} y", &v).unwrap(), "x 1 y");
        assert_eq!(
            render("x {{a}} {{b}}", &v),
            Err(ScriptError::Unreplaced("b".into()))
        );
        assert_eq!(render("x {{a", &v), Err(ScriptError::Unterminated));
        // values are not rescanned
        v.insert("a", "{{b}}".to_string());
        assert_eq!(render("{{a}}", &v).unwrap(), "{{b}}");
    }

    #[test]
    fn unknown_script_exits() {
        let s = unknown_script(Mac([0x52, 0x54, 0, 0, 0, 9])).unwrap();
        assert!(s.starts_with("#!ipxe"));
        assert!(s.contains("52:54:00:00:00:09"));
        assert!(s.contains("\nexit"));
    }

    #[test]
    fn shipped_boot_template_renders_completely() {
        let cfg = crate::StaticConfig::from_yaml(
            "serverIP: 10.77.0.1\ncidr: 10.77.0.0/24\ndhcp: {mode: proxy}\n\
             artifacts: {kernel: /k, initrd: /i}\n\
             machines: [{name: lab/m1, mac: \"52:54:00:00:00:01\", console: [ttyS0], chainUndionly: true}]\n",
        )
        .unwrap();
        let snap = cfg.snapshot(8080, "r".into()).unwrap();
        let mac = Mac([0x52, 0x54, 0, 0, 0, 1]);
        let m = snap.machines.get(&mac).unwrap();
        let s = boot_script(BOOT_TEMPLATE, &snap, mac, m).unwrap();
        assert!(!s.contains("{{"), "{s}");
        assert!(s.contains(
            "initrd=initrd.img anneal.machine=lab/m1 BOOTIF=01-52-54-00-00-00-01 console=ttyS0"
        ));
        assert!(s.contains("chain tftp://10.77.0.1/undionly.kpxe"));
    }

    #[test]
    fn grub_configs_render_completely() {
        let cfg = crate::StaticConfig::from_yaml(
            "serverIP: 10.77.0.1\ncidr: 10.77.0.0/24\ndhcp: {mode: proxy}\n\
             artifacts: {kernel: /k, initrd: /i}\n\
             machines: [{name: lab/m1, mac: \"52:54:00:00:00:01\", console: [ttyS0], bootLoader: shim, token: tok-secret}]\n",
        )
        .unwrap();
        let snap = cfg.snapshot(8080, "r".into()).unwrap();
        let first = grub_cfg().unwrap();
        assert!(!first.contains("{{"), "{first}");
        assert!(
            first.contains("\nconfigfile $prefix/${net_default_mac}\n"),
            "{first}"
        );
        // GRUB's ${net_default_mac} names the file
        let mac = grub_config_mac("grub/52:54:00:00:00:01").unwrap();
        assert_eq!(mac, Mac([0x52, 0x54, 0, 0, 0, 1]));
        assert_eq!(grub_config_mac("grub/grub.cfg"), None);
        assert_eq!(grub_config_mac("grub/x86_64-efi/command.lst"), None);
        let s = grub_config(&snap, mac).unwrap();
        assert!(!s.contains("{{"), "{s}");
        assert!(
            s.contains(
                "if linux /boot/kernel anneal.machine=lab/m1 BOOTIF=01-52-54-00-00-00-01 console=ttyS0; then"
            ),
            "{s}"
        );
        assert!(
            s.contains("initrd /token/52-54-00-00-00-01 /boot/initrd; then"),
            "{s}"
        );
        // the token travels in the cpio, never in the config
        assert!(!s.contains("tok-secret"), "{s}");
        assert_eq!(token_path_mac("token/52-54-00-00-00-01"), Some(mac));
        let stranger = grub_config(&snap, Mac([0x52, 0x54, 0, 0, 0, 9])).unwrap();
        assert!(
            stranger.contains("52:54:00:00:00:09 is not enrolled"),
            "{stranger}"
        );
        assert!(!stranger.contains("linux"), "{stranger}");
    }

    #[test]
    fn an_arm64_machine_boots_the_arm64_pair() {
        let yaml = |arm: &str| {
            format!(
                "serverIP: 10.77.0.1\ncidr: 10.77.0.0/24\ndhcp: {{mode: proxy}}\n\
                 artifacts: {{kernel: /k, initrd: /i{arm}}}\n\
                 machines:\n\
                 - {{name: lab/x, mac: \"52:54:00:00:00:01\", console: [ttyS0]}}\n\
                 - {{name: lab/a, mac: \"52:54:00:00:00:02\", console: [ttyAMA0], architecture: aarch64, bootLoader: shim}}\n"
            )
        };
        let x = Mac([0x52, 0x54, 0, 0, 0, 1]);
        let a = Mac([0x52, 0x54, 0, 0, 0, 2]);
        let snap = crate::StaticConfig::from_yaml(&yaml(", aarch64: {kernel: /ak, initrd: /ai}"))
            .unwrap()
            .snapshot(8080, "r".into())
            .unwrap();
        let ipxe = |mac| boot_script(BOOT_TEMPLATE, &snap, mac, snap.machines.get(&mac).unwrap());
        let s = ipxe(a).unwrap();
        assert!(
            s.contains("http://10.77.0.1:8080/boot/aarch64/kernel "),
            "{s}"
        );
        assert!(
            s.contains("http://10.77.0.1:8080/boot/aarch64/initrd "),
            "{s}"
        );
        assert!(s.contains("console=ttyAMA0"), "{s}");
        let s = ipxe(x).unwrap();
        assert!(s.contains("http://10.77.0.1:8080/boot/kernel "), "{s}");
        let g = grub_config(&snap, a).unwrap();
        assert!(g.contains("if linux /boot/aarch64/kernel "), "{g}");
        assert!(g.contains("initrd /boot/aarch64/initrd; then"), "{g}");
        // each path names its own pair
        let art = snap.artifacts.as_ref().unwrap();
        for (path, want) in [
            ("boot/kernel", "/k"),
            ("boot/initrd", "/i"),
            ("boot/aarch64/kernel", "/ak"),
            ("boot/aarch64/initrd", "/ai"),
        ] {
            let (arch, kernel) = crate::config::parse_boot_path(path).unwrap();
            let (k, i) = art.for_arch(arch).unwrap();
            assert_eq!(if kernel { k } else { i }, std::path::Path::new(want));
        }
        for bad in [
            "boot/",
            "boot/aarch64/",
            "boot/aarch64/x",
            "boot/riscv64/kernel",
            "kernel",
        ] {
            assert_eq!(crate::config::parse_boot_path(bad), None, "{bad}");
        }

        // without an arm64 pair the arm64 machine gets no script, and the
        // error says what to configure; the x86_64 one still boots
        let snap = crate::StaticConfig::from_yaml(&yaml(""))
            .unwrap()
            .snapshot(8080, "r".into())
            .unwrap();
        let m = snap.machines.get(&a).unwrap();
        let e = boot_script(BOOT_TEMPLATE, &snap, a, m).unwrap_err();
        assert_eq!(e, ScriptError::NoArtifactsFor("aarch64"));
        assert!(e.to_string().contains("artifacts.aarch64"), "{e}");
        assert_eq!(grub_config(&snap, a).unwrap_err(), e);
        assert!(boot_script(BOOT_TEMPLATE, &snap, x, snap.machines.get(&x).unwrap()).is_ok());
    }

    #[test]
    fn bad_console_is_refused() {
        assert!(arg("console", "ttyS0 115200").is_err());
        assert_eq!(
            arg("console", "ttyS0,115200").unwrap(),
            "console=ttyS0,115200"
        );
    }
}
