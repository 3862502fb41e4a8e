//! Parsing of `/proc/self/mountinfo`.

use std::path::PathBuf;

/// One line of mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    pub id: u32,
    pub parent: u32,
    /// `major:minor` of the mounted device.
    pub dev: String,
    /// The path inside the filesystem that is mounted (not `/` for binds).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    pub options: Vec<String>,
    pub fstype: String,
    pub source: String,
    pub super_options: Vec<String>,
}

impl MountInfo {
    pub fn readonly(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }
}

/// Undoes the kernel's octal escapes (`\040` for a space and so on).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') as u32 * 64
                + (bytes[i + 2] - b'0') as u32 * 8
                + (bytes[i + 3] - b'0') as u32;
            if v <= 255 {
                out.push(v as u8);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text; malformed lines are skipped, never a panic.
pub fn parse_mountinfo(text: &str) -> Vec<MountInfo> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<MountInfo> {
    let (left, right) = line.split_once(" - ")?;
    let mut l = left.split(' ');
    let id = l.next()?.parse().ok()?;
    let parent = l.next()?.parse().ok()?;
    let dev = l.next()?.to_string();
    let root = PathBuf::from(unescape(l.next()?));
    let mount_point = PathBuf::from(unescape(l.next()?));
    let options = l.next()?.split(',').map(str::to_string).collect();
    let mut r = right.split(' ');
    let fstype = r.next()?.to_string();
    let source = unescape(r.next()?);
    let super_options = r
        .next()
        .unwrap_or("")
        .split(',')
        .map(str::to_string)
        .collect();
    Some(MountInfo {
        id,
        parent,
        dev,
        root,
        mount_point,
        options,
        fstype,
        source,
        super_options,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = "\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
98 22 7:0 / /var/lib/kubelet/plugins/kubernetes.io/csi/staging/abc rw,noatime shared:50 - ext4 /dev/loop0 rw
99 22 7:0 / /var/lib/kubelet/pods/p1/volumes/kubernetes.io~csi/pvc\\0401/mount ro,relatime shared:50 master:3 - ext4 /dev/loop0 rw
100 22 0:5 /loop1 /tmp/blk ro - devtmpfs udev rw,size=1k
garbage line
";

    #[test]
    fn parses_fields_optional_tags_and_escapes() {
        let m = parse_mountinfo(FIXTURE);
        assert_eq!(m.len(), 4);
        assert_eq!(m[1].source, "/dev/loop0");
        assert_eq!(m[1].fstype, "ext4");
        assert!(!m[1].readonly());
        assert_eq!(
            m[2].mount_point,
            PathBuf::from("/var/lib/kubelet/pods/p1/volumes/kubernetes.io~csi/pvc 1/mount")
        );
        assert!(m[2].readonly());
        assert_eq!(m[3].root, PathBuf::from("/loop1"));
        assert_eq!(m[3].super_options, vec!["rw", "size=1k"]);
    }

    #[test]
    fn never_panics_on_junk() {
        for junk in [
            "",
            " - ",
            "1 2 3 - x",
            "a b c d e f - g h i",
            "1 2 3 \\777 /x rw - a b",
            "\\",
            "1 2 3 / \\0 rw - x y",
        ] {
            let _ = parse_mountinfo(junk);
        }
    }
}
