//! Property tests over random input (a seeded generator; the seed is
//! printed, FERROVOL_SEED replays it): the parsers that take outside input
//! never panic, and what they accept is safe.

use ferrovol::config::Config;
use ferrovol::mount::{parse_mountinfo, MountOptions};
use ferrovol::node::paths;
use ferrovol::plugin::{
    is_locator, join_fields, locator_for_name, split_fields, validate_name, SnapshotId, VolumeId,
};

mod common;

use common::Rng;

/// Random input for the parsers.
trait Gen {
    fn pick(&mut self, n: usize) -> usize;
    fn string(&mut self, max: usize) -> String;
}

impl Gen for Rng {
    fn pick(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// A string from an alphabet rich in the characters that matter.
    fn string(&mut self, max: usize) -> String {
        const PIECES: &[&str] = &[
            "a",
            "Z",
            "0",
            "9",
            "-",
            "_",
            ".",
            "..",
            "/",
            ":",
            " ",
            "\t",
            "\n",
            "\\",
            "\\040",
            "\0",
            "=",
            ",",
            ";",
            "$",
            "(",
            ")",
            "'",
            "\"",
            "~",
            "é",
            "\u{7f}",
            "\u{85}",
            "file",
            "lvm",
            "pvc-",
            "ext4",
            "/dev/loop0",
            "../",
            "//",
            "{",
            "}",
            "[",
            "]",
            "#",
            "*",
            "@",
            "ro",
            "bind",
            " - ",
            "h-",
        ];
        let len = self.pick(max + 1);
        let mut s = String::new();
        for _ in 0..len {
            s.push_str(PIECES[self.pick(PIECES.len())]);
        }
        s
    }
}

const ROUNDS: usize = 20_000;

#[test]
fn id_parsing_never_panics_and_accepts_only_safe_ids() {
    let mut rng = Rng::seeded("ids");
    for _ in 0..ROUNDS {
        let raw = rng.string(12);
        if let Ok(id) = VolumeId::parse(&raw) {
            assert!(is_locator(id.locator()), "{raw:?}");
            assert!(
                !id.locator().contains('/') && !id.locator().contains(".."),
                "{raw:?}"
            );
            assert_eq!(id.to_string(), raw, "ids round-trip");
            assert!(raw.len() <= 128);
        }
        let _ = SnapshotId::parse(&raw);
        let name = rng.string(20);
        let loc = locator_for_name(&name);
        assert!(is_locator(&loc) && loc.len() <= 100, "{name:?} -> {loc:?}");
        let _ = validate_name("volume", &name);
    }
}

/// Structured locators: any fields that fit come back exactly, the result
/// is always a safe locator inside an id's size, and decoding never accepts
/// a locator that encoding would not produce.
#[test]
fn locator_fields_round_trip_and_stay_safe() {
    let mut rng = Rng::seeded("fields");
    for _ in 0..ROUNDS {
        let n = 1 + rng.pick(3);
        let fields: Vec<String> = (0..n).map(|_| rng.string(8)).collect();
        let refs: Vec<&str> = fields.iter().map(String::as_str).collect();
        match join_fields(&refs) {
            Ok(locator) => {
                assert!(is_locator(&locator), "{fields:?} -> {locator:?}");
                assert!(VolumeId::new("nfs", &locator).is_ok(), "{locator:?}");
                assert_eq!(split_fields(&locator, n).unwrap(), fields);
            }
            Err(e) => assert!(e.message.contains("bytes"), "{fields:?}: {}", e.message),
        }
        // Random text decodes only if it is the one encoding of its fields.
        let raw = format!("v1.{}", rng.string(10));
        if let Ok(decoded) = split_fields(&raw, 1 + raw.matches('.').count() - 1) {
            let refs: Vec<&str> = decoded.iter().map(String::as_str).collect();
            assert_eq!(join_fields(&refs).unwrap(), raw, "{raw:?} is not canonical");
        }
    }
}

#[test]
fn mountinfo_parsing_never_panics_and_reads_whole_lines() {
    let mut rng = Rng::seeded("mountinfo");
    let real = "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n";
    // The control, and an unmutated line among mutated ones is read whole.
    let control = parse_mountinfo(real);
    assert_eq!(control.len(), 1);
    assert_eq!(
        (
            control[0].mount_point.to_str().unwrap(),
            control[0].fstype.as_str(),
            control[0].source.as_str()
        ),
        ("/mnt2", "ext3", "/dev/root")
    );
    for _ in 0..ROUNDS / 4 {
        let text = format!("{}\n{real}{}\n", rng.string(30), rng.string(30));
        let found = parse_mountinfo(&text);
        assert!(
            found.iter().any(|m| m.mount_point.to_str() == Some("/mnt2")
                && m.fstype == "ext3"
                && m.source == "/dev/root"),
            "{text:?}"
        );
    }
    for _ in 0..ROUNDS {
        let mut text = String::new();
        for _ in 0..rng.pick(4) {
            if rng.pick(2) == 0 {
                let cut = rng.pick(real.len());
                text.push_str(&real[..cut]);
                text.push_str(&rng.string(6));
                text.push_str(&real[cut..]);
            } else {
                text.push_str(&rng.string(30));
                text.push('\n');
            }
        }
        for m in parse_mountinfo(&text) {
            assert!(!m.fstype.contains(' '));
        }
    }
}

#[test]
fn mount_options_accept_only_plain_option_text() {
    let mut rng = Rng::seeded("mount options");
    for _ in 0..ROUNDS {
        let flags: Vec<String> = (0..rng.pick(4)).map(|_| rng.string(5)).collect();
        if let Ok(o) = MountOptions::parse(&flags, rng.pick(2) == 0) {
            for d in &o.data {
                assert!(
                    d.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-=.:+/@".contains(c)),
                    "{d:?} from {flags:?}"
                );
                assert!(d != "bind");
            }
        }
    }
}

#[test]
fn request_paths_are_normal_and_absolute() {
    let mut rng = Rng::seeded("paths");
    for _ in 0..ROUNDS {
        let raw = format!(
            "{}{}",
            if rng.pick(3) == 0 { "" } else { "/" },
            rng.string(10)
        );
        if let Ok(p) = paths::validate(&raw, "p") {
            let s = p.to_str().unwrap();
            assert!(s.starts_with('/'), "{raw:?}");
            assert!(!s.split('/').any(|c| c == ".." || c == "."), "{raw:?}");
            assert!(!s.contains('\0') && !s.contains("//"), "{raw:?}");
        }
    }
}

/// Whether a mutation at `cut` left `part` of `base` untouched.
fn untouched(base: &str, part: &str, cut: usize) -> bool {
    let at = base.find(part).unwrap();
    cut < at || cut > at + part.len()
}

#[test]
fn config_parsing_never_panics_and_reads_what_the_text_says() {
    let mut rng = Rng::seeded("config");
    let base = "default_backend = \"file\"\n[node]\nmax_volumes_per_node = 3\n[[backend]]\ntype = \"file\"\npool = \"/p\"\nmax_volume_size = \"1Gi\"\n";
    // The control: the text as written is read as written.
    let c = Config::parse(base).unwrap();
    assert_eq!(c.default_backend.as_deref(), Some("file"));
    assert_eq!(c.node.max_volumes_per_node, 3);
    assert_eq!(c.backends.len(), 1);
    let mut accepted = 0;
    for _ in 0..ROUNDS / 4 {
        let cut = rng.pick(base.len());
        let text = format!("{}{}{}", &base[..cut], rng.string(4), &base[cut..]);
        let Ok(c) = Config::parse(&text) else {
            continue;
        };
        accepted += 1;
        // A value whose line the mutation did not touch is read as
        // written: nothing elsewhere changes it.
        if untouched(base, "default_backend = \"file\"", cut) {
            assert_eq!(c.default_backend.as_deref(), Some("file"), "{text:?}");
        }
        assert!(c.backends.len() <= 1, "{text:?}");
        for b in &c.backends {
            if let Ok(f) = b.settings::<ferrovol::backend::file::FileSettings>() {
                if untouched(base, "pool = \"/p\"", cut) {
                    assert_eq!(f.pool, std::path::Path::new("/p"), "{text:?}");
                }
            }
            let _ = b.settings::<ferrovol::backend::lvm::LvmSettings>();
        }
    }
    assert!(
        accepted > 0,
        "no mutation was ever accepted: the property was never tried"
    );
}

#[test]
fn lvm_reports_never_panic_and_read_what_the_text_says() {
    let mut rng = Rng::seeded("lvm reports");
    let base = r#"{"report":[{"lv":[{"lv_name":"fv-a","vg_name":"vg","lv_size":"1048576","lv_tags":"ferrovol","lv_attr":"-wi-a-----","origin":"","pool_lv":"","lv_time":"2026-11-22 00:26:21 +0000","data_percent":""}]}]}"#;
    // The control: the report as lvm prints it.
    let rows = ferrovol::backend::lvm::parse_lvs(base).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].lv_name.as_str(), rows[0].lv_size.as_str()),
        ("fv-a", "1048576")
    );
    let mut accepted = 0;
    for _ in 0..ROUNDS / 4 {
        let cut = rng.pick(base.len());
        let text = format!("{}{}{}", &base[..cut], rng.string(3), &base[cut..]);
        if let Ok(rows) = ferrovol::backend::lvm::parse_lvs(&text) {
            accepted += 1;
            assert!(rows.len() <= 1, "{text:?}");
            for r in rows {
                for (part, got, want) in [
                    (r#""lv_name":"fv-a""#, &r.lv_name, "fv-a"),
                    (r#""vg_name":"vg""#, &r.vg_name, "vg"),
                    (r#""lv_size":"1048576""#, &r.lv_size, "1048576"),
                    (r#""lv_attr":"-wi-a-----""#, &r.lv_attr, "-wi-a-----"),
                ] {
                    if untouched(base, part, cut) {
                        assert_eq!(got, want, "{text:?}");
                    }
                }
            }
        }
        // A vgs parse of an lvs report finds no group.
        if let Ok(groups) = ferrovol::backend::lvm::parse_vgs(&text) {
            assert!(groups.is_empty(), "{text:?}");
        }
    }
    assert!(
        accepted > 0,
        "no mutation was ever accepted: the property was never tried"
    );
}

#[test]
fn backend_parameters_never_panic_and_unknown_keys_are_refused() {
    use std::collections::BTreeMap;
    let mut rng = Rng::seeded("parameters");
    let lvm: ferrovol::backend::lvm::LvmSettings =
        toml::from_str("[[device_class]]\nname = \"fast\"\nvolume_group = \"vg0\"\n").unwrap();
    // Checking parameters runs no command.
    let runner = std::sync::Arc::new(ferrovol::exec::SystemRunner::default());
    let backend = ferrovol::backend::lvm::LvmBackend::new("lvm", lvm, runner).unwrap();
    for _ in 0..ROUNDS / 4 {
        let params: BTreeMap<String, String> = (0..rng.pick(3))
            .map(|_| (rng.string(3), rng.string(3)))
            .collect();
        // As the controller checks them: the keys its kind takes, then
        // their values.
        let ok = ferrovol::plugin::check_parameters(&backend, &params).is_ok();
        let only_known = params
            .iter()
            .all(|(k, v)| k == "deviceClass" && v == "fast");
        assert_eq!(ok, only_known, "{params:?}");
    }
}
