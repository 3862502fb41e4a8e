//! Loop devices over image files: attach, find, refresh and detach through
//! the kernel's loop driver (`/dev/loop-control` and the devices' ioctls,
//! behind the [`LoopKernel`] seam; what `losetup` does, without a process
//! per call), with attachments read from sysfs.
//!
//! A device is known by the device and inode numbers of its backing file
//! (what the kernel keeps from the open file), never by the path text
//! sysfs shows: that text is the path as the process that attached it saw
//! it, and once that process's mount namespace is gone (a container
//! replaced) it reads otherwise (`/pool/x.img` for
//! `/var/lib/ferrovol/local/pool/x.img`). An image deleted while attached
//! can only be found by its text.
//!
//! Which device backs which image is kept in an index, read from sysfs once
//! (every `loopN`, attached or not: a machine that has made many keeps
//! them all, 962 on this one) and kept as this process attaches and
//! detaches. Each use checks the one device it names; none is scanned per
//! call, so attaching costs the same with 10 images or 10,000. The images
//! are the driver's own: nothing else attaches them.

use crate::error::{Error, Result};
use crate::sync::LockExt;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How long one loop ioctl may take (they block on nothing but the
/// driver's own locks; a stuck one fails the call, UNAVAILABLE).
const IOCTL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a detach may take to be final.
const DETACH_WAIT: Duration = Duration::from_secs(10);

/// Loop device management rooted at a sysfs path (tests use a fixture tree).
#[derive(Clone)]
pub struct LoopDevices {
    kernel: Arc<dyn LoopKernel>,
    sysfs_block: PathBuf,
    index: Arc<Index>,
}

/// What the kernel's loop driver does for us. Blocking calls: run off the
/// async workers.
pub trait LoopKernel: Send + Sync {
    /// A free loop device set up over `backing`: its path.
    fn attach(&self, backing: &Path, read_only: bool) -> Result<PathBuf>;
    /// Lets go of `device` (the kernel finishes when its last user closes
    /// it).
    fn detach(&self, device: &Path) -> Result<()>;
    /// Makes `device` see its backing file's current size.
    fn set_capacity(&self, device: &Path) -> Result<()>;
    /// The identity of `device`'s backing file; `None` when it has none
    /// (not set up, or gone).
    fn backing_id(&self, device: &Path) -> Option<FileId>;
}

/// A file's identity: its filesystem's device number and its inode, as
/// `stat` and the loop driver's status both give them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

impl FileId {
    /// The identity of the file at `path`, if it exists.
    pub fn of(path: &Path) -> Option<FileId> {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).ok().map(|m| FileId {
            dev: m.dev(),
            ino: m.ino(),
        })
    }
}

/// The real loop driver, through its ioctls.
pub struct Ioctls;

// The loop driver's ioctls (linux/loop.h), numbered by hand as the header
// does; nix wraps the call, the numbers and the structure are ours.
#[allow(unsafe_code)] // nix's ioctl wrappers are unsafe fns: the argument is ours and sized
mod sys {
    pub const LO_FLAGS_READ_ONLY: u32 = 1;
    /// `struct loop_info64`.
    #[repr(C)]
    pub struct LoopInfo64 {
        pub lo_device: u64,
        pub lo_inode: u64,
        pub lo_rdevice: u64,
        pub lo_offset: u64,
        pub lo_sizelimit: u64,
        pub lo_number: u32,
        pub lo_encrypt_type: u32,
        pub lo_encrypt_key_size: u32,
        pub lo_flags: u32,
        pub lo_file_name: [u8; 64],
        pub lo_crypt_name: [u8; 64],
        pub lo_encrypt_key: [u8; 32],
        pub lo_init: [u64; 2],
    }
    /// `struct loop_config` (LOOP_CONFIGURE, Linux 5.8).
    #[repr(C)]
    pub struct LoopConfig {
        pub fd: u32,
        pub block_size: u32,
        pub info: LoopInfo64,
        pub reserved: [u64; 8],
    }
    nix::ioctl_none_bad!(ctl_get_free, 0x4C82);
    nix::ioctl_write_ptr_bad!(configure, 0x4C0A, LoopConfig);
    nix::ioctl_none_bad!(clr_fd, 0x4C01);
    nix::ioctl_none_bad!(set_capacity, 0x4C07);
    nix::ioctl_read_bad!(get_status64, 0x4C05, LoopInfo64);
}

impl Ioctls {
    fn device_fd(device: &Path) -> Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(device)
            .map_err(|e| Error::io(format!("open {}", device.display()), e))
    }
}

#[allow(unsafe_code)] // the ioctls above, on descriptors this function owns
impl LoopKernel for Ioctls {
    fn attach(&self, backing: &Path, read_only: bool) -> Result<PathBuf> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(backing)
            .map_err(|e| Error::io(format!("open {}", backing.display()), e))?;
        let control = Self::device_fd(Path::new("/dev/loop-control"))?;
        // Another process may take the free device first: EBUSY, try the
        // next free one.
        for _ in 0..16 {
            // SAFETY: LOOP_CTL_GET_FREE takes no argument.
            let n = unsafe { sys::ctl_get_free(control.as_raw_fd()) }
                .map_err(|e| Error::io("find a free loop device", e.into()))?;
            let device = PathBuf::from(format!("/dev/loop{n}"));
            let dev = Self::device_fd(&device)?;
            let mut name = [0u8; 64];
            let path = backing.as_os_str().as_encoded_bytes();
            let len = path.len().min(63);
            name[..len].copy_from_slice(&path[..len]);
            let config = sys::LoopConfig {
                fd: file.as_raw_fd() as u32,
                block_size: 0,
                info: sys::LoopInfo64 {
                    lo_device: 0,
                    lo_inode: 0,
                    lo_rdevice: 0,
                    lo_offset: 0,
                    lo_sizelimit: 0,
                    lo_number: 0,
                    lo_encrypt_type: 0,
                    lo_encrypt_key_size: 0,
                    lo_flags: if read_only {
                        sys::LO_FLAGS_READ_ONLY
                    } else {
                        0
                    },
                    lo_file_name: name,
                    lo_crypt_name: [0; 64],
                    lo_encrypt_key: [0; 32],
                    lo_init: [0; 2],
                },
                reserved: [0; 8],
            };
            // SAFETY: `config` is a complete struct loop_config that lives
            // across the call; the kernel takes its own reference to the
            // backing file.
            match unsafe { sys::configure(dev.as_raw_fd(), &config) } {
                Ok(_) => return Ok(device),
                Err(nix::errno::Errno::EBUSY) => continue,
                Err(e) => {
                    return Err(Error::io(
                        format!("set up {} over {}", device.display(), backing.display()),
                        e.into(),
                    ))
                }
            }
        }
        Err(Error::unavailable(
            "every free loop device was taken by another process first; try again",
        ))
    }

    fn detach(&self, device: &Path) -> Result<()> {
        use std::os::fd::AsRawFd;
        let dev = Self::device_fd(device)?;
        // SAFETY: LOOP_CLR_FD takes no argument.
        match unsafe { sys::clr_fd(dev.as_raw_fd()) } {
            // ENXIO: not set up (detached already).
            Ok(_) | Err(nix::errno::Errno::ENXIO) => Ok(()),
            Err(e) => Err(Error::io(format!("detach {}", device.display()), e.into())),
        }
    }

    fn set_capacity(&self, device: &Path) -> Result<()> {
        use std::os::fd::AsRawFd;
        let dev = Self::device_fd(device)?;
        // SAFETY: LOOP_SET_CAPACITY takes no argument.
        unsafe { sys::set_capacity(dev.as_raw_fd()) }
            .map(|_| ())
            .map_err(|e| {
                Error::io(
                    format!("refresh the size of {}", device.display()),
                    e.into(),
                )
            })
    }

    fn backing_id(&self, device: &Path) -> Option<FileId> {
        use std::os::fd::AsRawFd;
        // Reading the status needs no write access.
        let dev = std::fs::File::open(device).ok()?;
        // SAFETY: an all-zero struct loop_info64 is valid; the kernel
        // fills it in.
        let mut info: sys::LoopInfo64 = unsafe { std::mem::zeroed() };
        // SAFETY: LOOP_GET_STATUS64 writes one struct loop_info64, which
        // `info` is; ENXIO means the device is not set up.
        unsafe { sys::get_status64(dev.as_raw_fd(), &mut info) }.ok()?;
        // The kernel encodes the device number as stat(2) does.
        Some(FileId {
            dev: info.lo_device,
            ino: info.lo_inode,
        })
    }
}

/// Backing file → device name (`loop7`), once read from sysfs; and the
/// lock that makes "not attached, so attach" one step.
#[derive(Default)]
struct Index {
    devices: std::sync::Mutex<Option<HashMap<FileId, String>>>,
    attaching: tokio::sync::Mutex<()>,
}

impl LoopDevices {
    pub fn new() -> Self {
        Self::with_sysfs(Arc::new(Ioctls), "/sys/block")
    }

    pub fn with_sysfs(kernel: Arc<dyn LoopKernel>, sysfs_block: impl Into<PathBuf>) -> Self {
        Self {
            kernel,
            sysfs_block: sysfs_block.into(),
            index: Arc::default(),
        }
    }

    /// Runs one call into the loop driver off the async workers.
    async fn kernel<T: Send + 'static>(
        &self,
        what: &str,
        call: impl FnOnce(&dyn LoopKernel) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let kernel = self.kernel.clone();
        super::off_worker(what, IOCTL_TIMEOUT, move || call(kernel.as_ref())).await
    }

    /// Every attached loop device's backing file, read from sysfs (which
    /// devices are set up) and the devices themselves (what backs them).
    fn scan(&self) -> HashMap<FileId, String> {
        let mut found = HashMap::new();
        let Ok(entries) = std::fs::read_dir(&self.sysfs_block) else {
            return found;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("loop") {
                continue;
            }
            if !entry.path().join("loop/backing_file").exists() {
                continue;
            }
            if let Some(id) = self.kernel.backing_id(&Path::new("/dev").join(&name)) {
                found.insert(id, name);
            }
        }
        found
    }

    /// The loop device currently backed by `image`, if any: the index's
    /// entry, checked against the device itself (an entry whose device
    /// went away is dropped).
    pub fn find(&self, image: &Path) -> Option<PathBuf> {
        let id = FileId::of(image)?;
        let mut devices = self.index.devices.locked();
        let devices = devices.get_or_insert_with(|| self.scan());
        let name = devices.get(&id)?.clone();
        let device = PathBuf::from("/dev").join(&name);
        if self.backs(&device, image) {
            return Some(device);
        }
        devices.remove(&id);
        None
    }

    fn noted(&self, image: &Path, device: Option<&Path>) {
        let Some(id) = FileId::of(image) else {
            return;
        };
        let mut devices = self.index.devices.locked();
        let devices = devices.get_or_insert_with(|| self.scan());
        match device.and_then(|d| d.file_name()) {
            Some(name) => {
                devices.insert(id, name.to_string_lossy().into_owned());
            }
            None => {
                devices.remove(&id);
            }
        }
    }

    /// Whether `device` is a loop device backed by `image`: the same file
    /// (device and inode), whatever path the attaching process saw it by;
    /// an image no longer there (deleted while attached), by the path the
    /// kernel shows.
    pub fn backs(&self, device: &Path, image: &Path) -> bool {
        let Some(name) = device.file_name() else {
            return false;
        };
        let sysfs = self.sysfs_block.join(name).join("loop/backing_file");
        match FileId::of(image) {
            Some(id) => sysfs.exists() && self.kernel.backing_id(device) == Some(id),
            None => std::fs::read_to_string(sysfs)
                .map(|b| backing_path(&b) == image)
                .unwrap_or(false),
        }
    }

    /// The loop device for `image`, attaching one if none exists (the
    /// index is the overlap check: losetup's own `--nooverlap` reads every
    /// loop device, 7 ms at 962 of them against 1.5 ms without).
    pub async fn attach(&self, image: &Path) -> Result<PathBuf> {
        if let Some(dev) = self.find(image) {
            return Ok(dev);
        }
        let _attaching = self.index.attaching.lock().await;
        if let Some(dev) = self.find(image) {
            return Ok(dev);
        }
        let backing = image.to_path_buf();
        let dev = self
            .kernel("attach a loop device", move |k| k.attach(&backing, false))
            .await?;
        self.noted(image, Some(&dev));
        Ok(dev)
    }

    /// A new read-only loop device over `backing` (a block device): what a
    /// read-only publish of a raw block volume hands out, since a read-only
    /// bind of a device node does not stop writes through it.
    pub async fn attach_read_only(&self, backing: &Path) -> Result<PathBuf> {
        let backing = backing.to_path_buf();
        self.kernel("attach a read-only loop device", move |k| {
            k.attach(&backing, true)
        })
        .await
    }

    /// Detaches `device` if it is a read-only loop device over `backing`
    /// ([`LoopDevices::attach_read_only`]); anything else is left alone.
    pub async fn detach_read_only(&self, device: &Path, backing: &Path) -> Result<()> {
        let ro = device
            .file_name()
            .and_then(|n| std::fs::read_to_string(self.sysfs_block.join(n).join("ro")).ok())
            .is_some_and(|v| v.trim() == "1");
        if !ro || !self.backs(device, backing) {
            return Ok(());
        }
        self.detach_and_wait(device, backing).await
    }

    /// Detaches `device` if it still backs `image`; otherwise nothing to do.
    /// Waits until the kernel has really let go: a loop device still open
    /// somewhere is only marked for detach (autoclear), and the image must
    /// not be treated as free before it is.
    pub async fn detach(&self, device: &Path, image: &Path) -> Result<()> {
        if !self.backs(device, image) {
            // Also catch a device re-attached under another name.
            match self.find(image) {
                Some(other) => return Box::pin(self.detach(&other, image)).await,
                None => return Ok(()),
            }
        }
        self.detach_and_wait(device, image).await
    }

    async fn detach_and_wait(&self, device: &Path, image: &Path) -> Result<()> {
        let dev = device.to_path_buf();
        self.kernel("detach a loop device", move |k| k.detach(&dev))
            .await?;
        let deadline = std::time::Instant::now() + DETACH_WAIT;
        while self.backs(device, image) {
            if std::time::Instant::now() > deadline {
                return Err(Error::new(
                    crate::error::Kind::Unavailable,
                    format!("{} is still busy after detach; it will be released when its last user closes it", device.display()),
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Released: the index forgets it (not before: a device still
        // busy still backs the image, and must be found, not doubled).
        self.noted(image, None);
        Ok(())
    }

    /// Makes the device see its image's new size; returns the size in bytes.
    pub async fn refresh(&self, device: &Path) -> Result<u64> {
        let dev = device.to_path_buf();
        self.kernel("refresh a loop device's size", move |k| {
            k.set_capacity(&dev)
        })
        .await?;
        self.size(device)
    }

    /// The device's size in bytes, from sysfs.
    pub fn size(&self, device: &Path) -> Result<u64> {
        let name = device
            .file_name()
            .ok_or_else(|| Error::internal("device path has no name"))?;
        let path = self.sysfs_block.join(name).join("size");
        let sectors: u64 = std::fs::read_to_string(&path)
            .map_err(|e| Error::io(format!("read {}", path.display()), e))?
            .trim()
            .parse()
            .map_err(|_| Error::internal(format!("unreadable {}", path.display())))?;
        Ok(sectors * 512)
    }
}

/// The image path in a sysfs `backing_file`. An image deleted while
/// attached reads `<path> (deleted)`: it is still that image's device, and
/// must still be found so it can be released.
fn backing_path(text: &str) -> &Path {
    let t = text.trim_end_matches('\n');
    Path::new(t.strip_suffix(" (deleted)").unwrap_or(t))
}

impl Default for LoopDevices {
    fn default() -> Self {
        Self::new()
    }
}

/// A loop driver over a fixture sysfs tree: attaching writes the device's
/// `loop/backing_file` as the kernel shows it, detaching removes it (when
/// the device is not held open: `busy` keeps it a while, as the kernel's
/// deferred release does). Records each call.
#[cfg(test)]
pub struct FakeLoops {
    sysfs: PathBuf,
    next: std::sync::Mutex<u32>,
    pub calls: std::sync::Mutex<Vec<String>>,
    /// Refuse attaches with this message.
    pub refuse: std::sync::Mutex<Option<String>>,
    /// Let go of a device at once on detach (as the kernel does when no
    /// one holds it open); otherwise the test releases it itself.
    release_on_detach: bool,
    /// The identity each backing file had when last seen.
    ids: std::sync::Mutex<HashMap<PathBuf, FileId>>,
}

#[cfg(test)]
impl FakeLoops {
    pub fn new(sysfs: &Path, first: u32) -> Self {
        FakeLoops {
            sysfs: sysfs.to_path_buf(),
            next: std::sync::Mutex::new(first),
            calls: Default::default(),
            refuse: Default::default(),
            release_on_detach: false,
            ids: Default::default(),
        }
    }
    /// The same, releasing each device as soon as it is detached.
    pub fn releasing(mut self) -> Self {
        self.release_on_detach = true;
        self
    }
    pub fn calls(&self) -> Vec<String> {
        self.calls.locked().clone()
    }
}

#[cfg(test)]
impl LoopKernel for FakeLoops {
    fn attach(&self, backing: &Path, read_only: bool) -> Result<PathBuf> {
        self.calls.locked().push(format!(
            "attach {}{}",
            backing.display(),
            if read_only { " ro" } else { "" }
        ));
        if let Some(why) = self.refuse.locked().clone() {
            return Err(Error::io(why, std::io::Error::from_raw_os_error(16)));
        }
        if let Some(id) = FileId::of(backing) {
            self.ids.locked().insert(backing.to_path_buf(), id);
        }
        let mut next = self.next.locked();
        let name = format!("loop{next}");
        *next += 1;
        let d = self.sysfs.join(&name);
        std::fs::create_dir_all(d.join("loop")).unwrap();
        std::fs::write(
            d.join("loop/backing_file"),
            format!("{}\n", backing.display()),
        )
        .unwrap();
        std::fs::write(d.join("size"), "2048").unwrap();
        std::fs::write(d.join("ro"), if read_only { "1" } else { "0" }).unwrap();
        Ok(PathBuf::from("/dev").join(name))
    }
    fn detach(&self, device: &Path) -> Result<()> {
        self.calls
            .locked()
            .push(format!("detach {}", device.display()));
        // As the kernel does: the device no longer has a backing file.
        if let Some(name) = device.file_name().filter(|_| self.release_on_detach) {
            let _ = std::fs::remove_dir_all(self.sysfs.join(name).join("loop"));
        }
        Ok(())
    }
    fn set_capacity(&self, device: &Path) -> Result<()> {
        self.calls
            .locked()
            .push(format!("set-capacity {}", device.display()));
        Ok(())
    }
    /// The file the fixture's `backing_file` names, as the kernel keeps it
    /// (an image deleted since keeps its identity: what was seen at
    /// attach).
    fn backing_id(&self, device: &Path) -> Option<FileId> {
        let name = device.file_name()?;
        let text = std::fs::read_to_string(self.sysfs.join(name).join("loop/backing_file")).ok()?;
        let path = backing_path(&text).to_path_buf();
        let mut seen = self.ids.locked();
        if let Some(id) = FileId::of(&path) {
            seen.insert(path, id);
            return Some(id);
        }
        seen.get(&path).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs tree with loop0 over image a and loop1 over image b, and
    /// a disk; images a to e exist in the pool.
    fn fixture() -> (tempfile::TempDir, PathBuf, Arc<FakeLoops>) {
        let dir = tempfile::tempdir().unwrap();
        let block = dir.path().join("block");
        std::fs::create_dir_all(dir.path().join("pool")).unwrap();
        for image in ["a", "b", "c", "d", "e"] {
            std::fs::write(dir.path().join(format!("pool/{image}.img")), "").unwrap();
        }
        for (name, backing, size) in [
            ("loop0", "a", "2048"),
            ("loop1", "b", "4096"),
            ("sda", "", "1"),
        ] {
            let d = block.join(name);
            std::fs::create_dir_all(d.join("loop")).unwrap();
            std::fs::write(d.join("size"), size).unwrap();
            if !backing.is_empty() {
                let image = dir.path().join(format!("pool/{backing}.img"));
                std::fs::write(
                    d.join("loop/backing_file"),
                    format!("{}\n", image.display()),
                )
                .unwrap();
            }
        }
        let kernel = Arc::new(FakeLoops::new(&block, 7));
        (dir, block, kernel)
    }

    fn img(dir: &tempfile::TempDir, name: &str) -> PathBuf {
        dir.path().join(format!("pool/{name}.img"))
    }

    /// A device attached by a process that saw the image by another path
    /// (through a bind mount in a container's mount namespace, gone since)
    /// is still that image's: found, reused, detached.
    #[tokio::test]
    async fn a_device_attached_through_another_path_is_the_image_s() {
        let (d, block, kernel) = fixture();
        let image = img(&d, "c");
        // The same file under another name, as another namespace's path
        // would be: the kernel shows that name.
        let other = d.path().join("elsewhere.img");
        std::fs::hard_link(&image, &other).unwrap();
        std::fs::create_dir_all(block.join("loop3/loop")).unwrap();
        std::fs::write(block.join("loop3/loop/backing_file"), "/pool/c.img\n").unwrap();
        kernel
            .ids
            .locked()
            .insert(PathBuf::from("/pool/c.img"), FileId::of(&image).unwrap());
        let loops = LoopDevices::with_sysfs(kernel.clone(), &block);
        assert_eq!(loops.find(&image), Some(PathBuf::from("/dev/loop3")));
        assert_eq!(loops.find(&other), Some(PathBuf::from("/dev/loop3")));
        assert_eq!(
            loops.attach(&image).await.unwrap(),
            PathBuf::from("/dev/loop3")
        );
        assert!(loops.backs(Path::new("/dev/loop3"), &image));
        assert!(!loops.backs(Path::new("/dev/loop3"), &img(&d, "d")));
        assert!(kernel.calls().is_empty(), "{:?}", kernel.calls());
    }

    #[tokio::test]
    async fn finds_existing_attachment_without_the_kernel() {
        let (d, block, kernel) = fixture();
        let loops = LoopDevices::with_sysfs(kernel.clone(), &block);
        assert_eq!(
            loops.attach(&img(&d, "b")).await.unwrap(),
            PathBuf::from("/dev/loop1")
        );
        assert!(kernel.calls().is_empty());
        assert_eq!(loops.size(Path::new("/dev/loop1")).unwrap(), 4096 * 512);
    }

    /// The index is read from sysfs once: a second attach finds the
    /// device the first made, and later calls read only the device they
    /// name (an attachment made behind the driver's back after the first
    /// read is not seen: the images are the driver's).
    #[tokio::test]
    async fn attachments_are_indexed_not_scanned() {
        let (d, block, kernel) = fixture();
        let loops = LoopDevices::with_sysfs(kernel.clone(), &block);
        let dev = loops.attach(&img(&d, "c")).await.unwrap();
        assert_eq!(dev, PathBuf::from("/dev/loop7"));
        assert_eq!(loops.attach(&img(&d, "c")).await.unwrap(), dev);
        assert_eq!(
            kernel.calls(),
            [format!("attach {}", img(&d, "c").display())]
        );
        std::fs::create_dir_all(block.join("loop9/loop")).unwrap();
        std::fs::write(
            block.join("loop9/loop/backing_file"),
            format!("{}\n", img(&d, "d").display()),
        )
        .unwrap();
        assert_eq!(loops.find(&img(&d, "d")), None);
        // A device that went away is dropped from the index.
        std::fs::remove_file(block.join("loop7/loop/backing_file")).unwrap();
        assert_eq!(loops.find(&img(&d, "c")), None);
        // A new instance reads sysfs afresh.
        let fresh = LoopDevices::with_sysfs(kernel.clone(), &block);
        assert_eq!(fresh.find(&img(&d, "d")), Some(PathBuf::from("/dev/loop9")));
    }

    /// Attaches of one image at once make one device.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn attaches_at_once_make_one_device() {
        let (d, block, kernel) = fixture();
        let loops = LoopDevices::with_sysfs(kernel.clone(), &block);
        let image = img(&d, "e");
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (loops, image) = (loops.clone(), image.clone());
                tokio::spawn(async move { loops.attach(&image).await.unwrap() })
            })
            .collect();
        let mut devices = std::collections::BTreeSet::new();
        for t in tasks {
            devices.insert(t.await.unwrap());
        }
        assert_eq!(devices.len(), 1);
        assert_eq!(
            kernel.calls(),
            [format!("attach {}", img(&d, "e").display())]
        );
    }

    #[tokio::test]
    async fn detach_only_touches_our_device() {
        let (d, block, kernel) = fixture();
        let loops = LoopDevices::with_sysfs(kernel.clone(), &block);
        // loop0 backs a.img, not c.img: nothing to detach.
        loops
            .detach(Path::new("/dev/loop0"), &img(&d, "c"))
            .await
            .unwrap();
        assert!(kernel.calls().is_empty());
        // The recorded device moved: the one really backing b.img is
        // detached, and detach waits until the kernel lets go of it.
        let backing = block.join("loop1/loop/backing_file");
        let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The kernel lets go only after the detach call (and a while later).
        let release = {
            let (kernel, released) = (kernel.clone(), released.clone());
            tokio::spawn(async move {
                while kernel.calls().is_empty() {
                    tokio::task::yield_now().await;
                }
                for _ in 0..5 {
                    tokio::task::yield_now().await;
                }
                released.store(true, std::sync::atomic::Ordering::SeqCst);
                std::fs::remove_file(backing).unwrap();
            })
        };
        loops
            .detach(Path::new("/dev/loop0"), &img(&d, "b"))
            .await
            .unwrap();
        assert!(
            released.load(std::sync::atomic::Ordering::SeqCst),
            "returned before the device was released"
        );
        release.await.unwrap();
        assert_eq!(kernel.calls(), ["detach /dev/loop1"]);
        // Released: a new attach makes a new device.
        let again = loops.attach(&img(&d, "b")).await.unwrap();
        assert_eq!(again, PathBuf::from("/dev/loop7"));
    }

    #[tokio::test]
    async fn a_refused_attach_is_reported() {
        let (d, block, kernel) = fixture();
        *kernel.refuse.lock().unwrap() = Some("no free loop device".into());
        let loops = LoopDevices::with_sysfs(kernel, &block);
        let err = loops.attach(&img(&d, "z")).await.unwrap_err();
        assert!(
            err.message.contains("no free loop device"),
            "{}",
            err.message
        );
        assert_eq!(loops.find(&img(&d, "z")), None);
    }
}
