//! Where files hold data, for changed block tracking: a file's data
//! extents (SEEK_DATA / SEEK_HOLE), and the blocks where two files differ.
//! Blocks both files map to the same place on the disk (FIEMAP: copies
//! that share extents, a reflink's) are equal without reading them; the
//! others are read from both and compared, so the answer is exact on any
//! filesystem and cheap where copies share their unchanged extents.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// A run of bytes of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Up to `max` extents from `start`, and where the next call starts (None:
/// there is nothing after them).
pub type Page = (Vec<Extent>, Option<u64>);

/// Appends `e`, merged into the last extent when they touch.
fn push(out: &mut Vec<Extent>, e: Extent) {
    match out.last_mut() {
        Some(last) if last.end() == e.offset => last.len += e.len,
        _ => out.push(e),
    }
}

/// lseek with SEEK_DATA or SEEK_HOLE; None past the end (ENXIO).
fn seek(file: &File, from: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    // SAFETY: lseek on a descriptor `file` owns; it moves only its offset.
    #[allow(unsafe_code)]
    let at = unsafe { libc::lseek(file.as_raw_fd(), from as libc::off_t, whence) };
    if at < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e);
    }
    Ok(Some(at as u64))
}

/// The extents of `file` holding data in `[start, end)`, at most `max`
/// (the filesystem's granularity: its blocks; a filesystem without
/// SEEK_DATA reports the whole file as data).
pub fn data_extents(file: &File, start: u64, end: u64, max: usize) -> io::Result<Page> {
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let Some(data) = seek(file, at, libc::SEEK_DATA)? else {
            break;
        };
        if data >= end {
            break;
        }
        let hole = seek(file, data, libc::SEEK_HOLE)?.unwrap_or(end).min(end);
        if out.len() == max {
            return Ok((out, Some(data)));
        }
        push(
            &mut out,
            Extent {
                offset: data,
                len: hole - data,
            },
        );
        at = hole;
    }
    Ok((out, None))
}

/// `struct fiemap_extent` (linux/fiemap.h).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

/// `struct fiemap` with room for `N` extents.
#[repr(C)]
struct Fiemap<const N: usize> {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [FiemapExtent; N],
}

const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// Extents whose place on the disk says nothing of their bytes: unknown,
/// delayed, encoded, unaligned, inline, tail.
const FIEMAP_EXTENT_OPAQUE: u32 = 0x2 | 0x4 | 0x8 | 0x100 | 0x200 | 0x400;

#[allow(unsafe_code)]
mod sys {
    // linux/fs.h: _IOWR('f', 11, struct fiemap).
    nix::ioctl_readwrite_bad!(fiemap, 0xC020_660B, libc::c_void);
}

/// Where `file`'s bytes in `[start, end)` lie on the disk: (logical,
/// physical, length) for each mapped extent whose place identifies its
/// bytes.
fn placed(file: &File, start: u64, end: u64) -> io::Result<Vec<(u64, u64, u64)>> {
    const N: usize = 64;
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let mut map = Fiemap::<N> {
            start: at,
            length: end - at,
            flags: FIEMAP_FLAG_SYNC,
            mapped_extents: 0,
            extent_count: N as u32,
            reserved: 0,
            extents: [FiemapExtent::default(); N],
        };
        // SAFETY: FS_IOC_FIEMAP on a descriptor `file` owns, with a struct
        // fiemap whose extent_count matches the room behind it.
        #[allow(unsafe_code)]
        let mapped = unsafe { sys::fiemap(file.as_raw_fd(), (&mut map as *mut Fiemap<N>).cast()) };
        match mapped {
            Ok(_) => {}
            // A filesystem without FIEMAP places nothing: every block is
            // compared.
            Err(nix::errno::Errno::EOPNOTSUPP | nix::errno::Errno::ENOTTY) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        }
        let n = (map.mapped_extents as usize).min(N);
        if n == 0 {
            break;
        }
        let mut last = false;
        for e in &map.extents[..n] {
            if e.flags & FIEMAP_EXTENT_OPAQUE == 0 {
                out.push((e.logical, e.physical, e.length));
            }
            last |= e.flags & FIEMAP_EXTENT_LAST != 0;
            at = at.max(e.logical + e.length);
        }
        if last {
            break;
        }
    }
    Ok(out)
}

/// The physical place of the block at `offset`, from a sorted map.
fn place_of(map: &[(u64, u64, u64)], offset: u64) -> Option<u64> {
    let i = map.partition_point(|(l, _, len)| l + len <= offset);
    map.get(i)
        .filter(|(l, _, _)| *l <= offset)
        .map(|(l, p, _)| p + (offset - l))
}

/// Reads up to `buf.len()` bytes at `offset`; what lies past the end of the
/// file reads as zeros.
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf[done..].fill(0);
    Ok(())
}

/// The blocks of `block` bytes in `[start, end)` whose bytes differ
/// between `a` and `b` (a block past either's end reads as zeros), merged
/// into extents, at most `max`. `same_disk`: the two files are on one
/// filesystem, so equal places mean equal bytes.
pub fn differing(
    a: &File,
    b: &File,
    same_disk: bool,
    start: u64,
    end: u64,
    block: u64,
    max: usize,
) -> io::Result<Page> {
    const WINDOW: u64 = 1 << 20;
    let start = start - start % block;
    let mut out: Vec<Extent> = Vec::new();
    let (mut ba, mut bb) = (vec![0u8; block as usize], vec![0u8; block as usize]);
    let mut at = start;
    while at < end {
        // Only where either holds data can they differ.
        let next_a = data_extents(a, at, end, 1)?.0.first().map(|e| e.offset);
        let next_b = data_extents(b, at, end, 1)?.0.first().map(|e| e.offset);
        let Some(from) = [next_a, next_b].into_iter().flatten().min() else {
            break;
        };
        let from = from - from % block;
        let to = (from + WINDOW).min(end);
        let (ma, mb) = if same_disk {
            (placed(a, from, to)?, placed(b, from, to)?)
        } else {
            (Vec::new(), Vec::new())
        };
        let mut off = from;
        while off < to {
            let len = block.min(to - off);
            let shared = match (place_of(&ma, off), place_of(&mb, off)) {
                (Some(pa), Some(pb)) => pa == pb,
                _ => false,
            };
            if !shared {
                read_at(a, &mut ba[..len as usize], off)?;
                read_at(b, &mut bb[..len as usize], off)?;
                if ba[..len as usize] != bb[..len as usize] {
                    let merges = out.last().is_some_and(|l| l.end() == off);
                    if !merges && out.len() == max {
                        return Ok((out, Some(off)));
                    }
                    push(&mut out, Extent { offset: off, len });
                }
            }
            off += len;
        }
        at = to;
    }
    Ok((out, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const B: u64 = 4096;

    fn file_with(dir: &std::path::Path, name: &str, size: u64, blocks: &[(u64, u8)]) -> File {
        let path = dir.join(name);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        f.set_len(size).unwrap();
        for (n, byte) in blocks {
            f.write_all_at(&vec![*byte; B as usize], n * B).unwrap();
        }
        f.sync_all().unwrap();
        f
    }

    #[test]
    fn data_extents_are_the_written_blocks_paged() {
        let dir = tempfile::tempdir().unwrap();
        let f = file_with(dir.path(), "a", 64 * B, &[(1, 1), (2, 2), (10, 3), (63, 4)]);
        let (all, next) = data_extents(&f, 0, 64 * B, 100).unwrap();
        // A filesystem may allocate more than was written around what
        // was, never less: every written block is inside an extent.
        for n in [1u64, 2, 10, 63] {
            assert!(
                all.iter()
                    .any(|e| e.offset <= n * B && n * B + B <= e.end()),
                "block {n} not in {all:?}"
            );
        }
        assert_eq!(next, None);
        // One at a time, each page starting where the last said.
        let (mut seen, mut at) = (Vec::new(), Some(0));
        while let Some(from) = at {
            let (page, next) = data_extents(&f, from, 64 * B, 1).unwrap();
            assert!(page.len() <= 1);
            seen.extend(page);
            at = next;
        }
        assert_eq!(seen, all);
        // From past the last data: nothing.
        assert_eq!(
            data_extents(&f, 64 * B, 64 * B, 10).unwrap(),
            (vec![], None)
        );
    }

    #[test]
    fn differing_blocks_are_exactly_those_written_since_the_copy() {
        let dir = tempfile::tempdir().unwrap();
        let base = file_with(
            dir.path(),
            "base",
            300 * B,
            &[(0, 1), (5, 1), (6, 1), (299, 9)],
        );
        // The target: the base copied (bytes, not extents), then blocks
        // 5 (changed), 7 (new), 200-201 (new), 299 (written, same bytes).
        let target = file_with(
            dir.path(),
            "target",
            300 * B,
            &[(0, 1), (5, 2), (6, 1), (7, 3), (200, 4), (201, 4), (299, 9)],
        );
        let (d, next) = differing(&base, &target, true, 0, 300 * B, B, 100).unwrap();
        assert_eq!(
            d,
            vec![
                Extent {
                    offset: 5 * B,
                    len: B
                },
                Extent {
                    offset: 7 * B,
                    len: B
                },
                Extent {
                    offset: 200 * B,
                    len: 2 * B
                },
            ]
        );
        assert_eq!(next, None);
        // Paged by one extent: the same, in order.
        let (mut seen, mut at) = (Vec::new(), Some(0));
        while let Some(from) = at {
            let (page, next) = differing(&base, &target, true, from, 300 * B, B, 1).unwrap();
            seen.extend(page);
            at = next;
        }
        assert_eq!(seen, d);
        // A target grown past the base: its new data differs (the base
        // reads as zeros there).
        let mut grown = target.try_clone().unwrap();
        grown.set_len(400 * B).unwrap();
        grown.write_all_at(&[7u8; 10], 350 * B).unwrap();
        grown.flush().unwrap();
        let (d, _) = differing(&base, &grown, true, 300 * B, 400 * B, B, 100).unwrap();
        assert_eq!(
            d,
            vec![Extent {
                offset: 350 * B,
                len: B
            }]
        );
    }

    #[test]
    fn places_are_read_from_the_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let f = file_with(dir.path(), "a", 16 * B, &[(3, 1)]);
        let map = placed(&f, 0, 16 * B).unwrap();
        // The test directory's filesystem (ext4 here) places block 3, and
        // nothing where nothing was written.
        let p = place_of(&map, 3 * B).expect("block 3 placed");
        assert_eq!(place_of(&map, 3 * B + 1), Some(p + 1));
        assert_eq!(place_of(&map, 8 * B), None);
        assert_eq!(place_of(&[(0, 100, 10)], 5), Some(105));
        assert_eq!(place_of(&[(0, 100, 10)], 10), None);
        assert_eq!(place_of(&[(0, 100, 10), (20, 500, 10)], 25), Some(505));
    }
}
