//! librbd and librados in the driver's process, on connections kept per
//! cephx user and key: a call costs the cluster's round trips, not a
//! process and a cephx handshake (about 30 ms each).
//!
//! The libraries are opened at run time (dlopen), so the binary runs where
//! Ceph's libraries are not installed; then the backend takes the command
//! line. The key reaches librados through `rados_conf_set` only: never a
//! file, an argument or a log. Every blocking call runs off the async
//! workers, under librados's own timeouts (monitor, OSD, mount) and an
//! outer deadline; a connection that timed out or was shut out by the
//! cluster is dropped, and the next call connects again.
//!
//! The functions and struct layouts are those of librbd.h and librados.h
//! (Ceph 16 and later; all are present since Ceph 15).

#![allow(unsafe_code)]

use super::cluster::{
    feature_bits, Cluster, DiffPage, Info, Inspected, Layout, Pager, Parent, Spec, TrashEntry,
};
use super::creds::Creds;
use crate::error::{Error, Kind, Result};
use crate::sync::LockExt;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

type Rados = *mut c_void;
type IoCtx = *mut c_void;
type Image = *mut c_void;
type Options = *mut c_void;

#[repr(C)]
struct ImageSpec {
    id: *mut c_char,
    name: *mut c_char,
}

#[repr(C)]
struct LinkedImageSpec {
    pool_id: i64,
    pool_name: *mut c_char,
    pool_namespace: *mut c_char,
    image_id: *mut c_char,
    image_name: *mut c_char,
    trash: bool,
}

#[repr(C)]
struct SnapSpec {
    id: u64,
    namespace_type: c_int,
    name: *mut c_char,
}

#[repr(C)]
struct TrashInfo {
    id: *mut c_char,
    name: *mut c_char,
    source: c_int,
    deletion_time: libc::time_t,
    deferment_end_time: libc::time_t,
}

#[repr(C)]
struct SnapInfo {
    id: u64,
    size: u64,
    name: *const c_char,
}

/// librbd.h's `rbd_group_info_t`.
#[repr(C)]
struct GroupInfo {
    name: *mut c_char,
    pool: i64,
}

#[repr(C)]
struct GroupNamespace {
    group_pool: i64,
    group_name: *mut c_char,
    group_snap_name: *mut c_char,
}

/// librbd.h's `RBD_SNAP_NAMESPACE_TYPE_USER` and `_GROUP`.
const SNAP_NAMESPACE_USER: c_int = 0;
const SNAP_NAMESPACE_GROUP: c_int = 1;
/// librbd.h's `RBD_FEATURE_EXCLUSIVE_LOCK`.
const FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;

#[repr(C)]
struct WatcherInfo {
    addr: *mut c_char,
    id: i64,
    cookie: u64,
}

/// librbd.h's `RBD_IMAGE_OPTION_*`.
const OPT_FEATURES: c_int = 1;
const OPT_DATA_POOL: c_int = 10;
const OPT_CLONE_FORMAT: c_int = 12;

macro_rules! api {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The functions of librados and librbd the backend calls.
        struct Api {
            $($name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        impl Api {
            fn load() -> std::result::Result<Api, String> {
                let rados = open("librados.so.2")?;
                let rbd = open("librbd.so.1")?;
                Ok(Api {
                    $($name: {
                        let lib = if stringify!($name).starts_with("rados_") { rados } else { rbd };
                        let sym = symbol(lib, stringify!($name))?;
                        // SAFETY: the symbol is the library's function of
                        // this name, whose C signature the field declares.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(sym) }
                    },)*
                })
            }
        }
    };
}

api! {
    rados_create2: fn(*mut Rados, *const c_char, *const c_char, u64) -> c_int;
    rados_conf_set: fn(Rados, *const c_char, *const c_char) -> c_int;
    rados_connect: fn(Rados) -> c_int;
    rados_wait_for_latest_osdmap: fn(Rados) -> c_int;
    rados_shutdown: fn(Rados);
    rados_ioctx_create: fn(Rados, *const c_char, *mut IoCtx) -> c_int;
    rados_ioctx_destroy: fn(IoCtx);
    rados_ioctx_set_namespace: fn(IoCtx, *const c_char);
    rados_mon_command: fn(Rados, *mut *const c_char, usize, *const c_char, usize,
        *mut *mut c_char, *mut usize, *mut *mut c_char, *mut usize) -> c_int;
    rados_buffer_free: fn(*mut c_char);
    rados_stat: fn(IoCtx, *const c_char, *mut u64, *mut libc::time_t) -> c_int;
    rados_read: fn(IoCtx, *const c_char, *mut c_char, usize, u64) -> c_int;
    rados_exec: fn(IoCtx, *const c_char, *const c_char, *const c_char, *const c_char, usize,
        *mut c_char, usize) -> c_int;
    rbd_image_options_create: fn(*mut Options);
    rbd_image_options_destroy: fn(Options);
    rbd_image_options_set_string: fn(Options, c_int, *const c_char) -> c_int;
    rbd_image_options_set_uint64: fn(Options, c_int, u64) -> c_int;
    rbd_create4: fn(IoCtx, *const c_char, u64, Options) -> c_int;
    rbd_clone3: fn(IoCtx, *const c_char, *const c_char, IoCtx, *const c_char, Options) -> c_int;
    rbd_remove: fn(IoCtx, *const c_char) -> c_int;
    rbd_rename: fn(IoCtx, *const c_char, *const c_char) -> c_int;
    rbd_trash_move: fn(IoCtx, *const c_char, u64) -> c_int;
    rbd_trash_list: fn(IoCtx, *mut TrashInfo, *mut usize) -> c_int;
    rbd_trash_list_cleanup: fn(*mut TrashInfo, usize);
    rbd_trash_remove: fn(IoCtx, *const c_char, bool) -> c_int;
    rbd_list2: fn(IoCtx, *mut ImageSpec, *mut usize) -> c_int;
    rbd_image_spec_list_cleanup: fn(*mut ImageSpec, usize);
    rbd_namespace_list: fn(IoCtx, *mut c_char, *mut usize) -> c_int;
    rbd_open: fn(IoCtx, *const c_char, *mut Image, *const c_char) -> c_int;
    rbd_open_read_only: fn(IoCtx, *const c_char, *mut Image, *const c_char) -> c_int;
    rbd_close: fn(Image) -> c_int;
    rbd_get_size: fn(Image, *mut u64) -> c_int;
    rbd_get_parent: fn(Image, *mut LinkedImageSpec, *mut SnapSpec) -> c_int;
    rbd_linked_image_spec_cleanup: fn(*mut LinkedImageSpec);
    rbd_snap_spec_cleanup: fn(*mut SnapSpec);
    rbd_resize: fn(Image, u64) -> c_int;
    rbd_flatten: fn(Image) -> c_int;
    rbd_snap_create: fn(Image, *const c_char) -> c_int;
    rbd_lock_acquire: fn(Image, c_int) -> c_int;
    rbd_lock_release: fn(Image) -> c_int;
    rbd_snap_remove: fn(Image, *const c_char) -> c_int;
    rbd_metadata_set: fn(Image, *const c_char, *const c_char) -> c_int;
    rbd_metadata_remove: fn(Image, *const c_char) -> c_int;
    rbd_metadata_list: fn(Image, *const c_char, u64, *mut c_char, *mut usize, *mut c_char, *mut usize) -> c_int;
    rbd_watchers_list: fn(Image, *mut WatcherInfo, *mut usize) -> c_int;
    rbd_watchers_list_cleanup: fn(*mut WatcherInfo, usize);
    rbd_get_features: fn(Image, *mut u64) -> c_int;
    rbd_snap_list: fn(Image, *mut SnapInfo, *mut c_int) -> c_int;
    rbd_snap_list_end: fn(*mut SnapInfo);
    rbd_snap_get_namespace_type: fn(Image, u64, *mut c_int) -> c_int;
    rbd_snap_get_group_namespace: fn(Image, u64, *mut GroupNamespace, usize) -> c_int;
    rbd_snap_group_namespace_cleanup: fn(*mut GroupNamespace, usize) -> c_int;
    rbd_snap_set_by_id: fn(Image, u64) -> c_int;
    rbd_copy3: fn(Image, IoCtx, *const c_char, Options) -> c_int;
    rbd_group_create: fn(IoCtx, *const c_char) -> c_int;
    rbd_group_remove: fn(IoCtx, *const c_char) -> c_int;
    rbd_group_image_add: fn(IoCtx, *const c_char, IoCtx, *const c_char) -> c_int;
    rbd_group_snap_create2: fn(IoCtx, *const c_char, *const c_char, u32) -> c_int;
    rbd_get_group: fn(Image, *mut GroupInfo, usize) -> c_int;
    rbd_group_info_cleanup: fn(*mut GroupInfo, usize) -> c_int;
    rados_ioctx_get_id: fn(IoCtx) -> i64;
    rbd_diff_iterate2: fn(Image, *const c_char, u64, u64, u8, u8,
        Option<unsafe extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int>, *mut c_void) -> c_int;
}

/// `rbd_diff_iterate2`'s callback: each extent into the [`Pager`] `arg`
/// points to; a full page ends the walk (ECANCELED, no error here).
unsafe extern "C" fn take_extent(
    offset: u64,
    len: usize,
    _exists: c_int,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: `arg` is the pager the caller lent for this walk only.
    let pager = unsafe { &mut *(arg as *mut Pager) };
    if pager.take(offset, len as u64) {
        0
    } else {
        -libc::ECANCELED
    }
}

fn open(name: &str) -> std::result::Result<*mut c_void, String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: a NUL-terminated name; the handle is never closed (the
    // libraries stay for the life of the process).
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(format!("{name}: {}", dl_error()));
    }
    Ok(h)
}

fn symbol(lib: *mut c_void, name: &str) -> std::result::Result<*mut c_void, String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: `lib` is a live handle from dlopen; the name is NUL-terminated.
    let sym = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if sym.is_null() {
        return Err(format!("{name}: {}", dl_error()));
    }
    Ok(sym)
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "not found".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();

fn api() -> std::result::Result<&'static Api, String> {
    API.get_or_init(Api::load).as_ref().map_err(Clone::clone)
}

fn cstr(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what} holds a NUL byte")))
}

/// Owned C string from librbd, or "" for null.
fn owned(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: librbd hands out NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Ceph's encoding of a string: a little-endian u32 length, the bytes.
fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s);
}

fn decode_string(b: &[u8]) -> Option<String> {
    let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    String::from_utf8(b.get(4..4 + len)?.to_vec()).ok()
}

/// `map<string, bufferlist>` as the `rbd` class's `metadata_set` takes it:
/// a u32 count, then each key and value as a length-prefixed string.
fn encode_metadata(set: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(set.len() as u32).to_le_bytes());
    for (k, v) in set {
        encode_string(&mut out, k.as_bytes());
        encode_string(&mut out, v.as_bytes());
    }
    out
}

/// The `map<string, bufferlist>` that `metadata_list` answers, in the
/// form [`encode_metadata`] writes.
fn decode_metadata(b: &[u8]) -> Option<Vec<(String, String)>> {
    let count = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    let mut at = 4;
    let mut out = Vec::with_capacity(count.min(1024));
    for _ in 0..count {
        let k = decode_string(b.get(at..)?)?;
        at += 4 + k.len();
        let v = decode_string(b.get(at..)?)?;
        at += 4 + v.len();
        out.push((k, v));
    }
    Some(out)
}

/// The object, in each pool and namespace, that records the images being
/// made there (see [`Ctx::making`]).
const MAKING: &str = "ferrovol.making";

/// A librbd listing that fills an array of `R`: called with room for a
/// few entries, again with the room it asks for (-ERANGE), then each filled
/// entry converted and the array handed back to librbd's `cleanup`.
fn listing<R, T>(
    what: impl Fn() -> String,
    first: usize,
    fill: impl Fn(*mut R, &mut usize) -> c_int,
    cleanup: unsafe extern "C" fn(*mut R, usize),
    convert: impl Fn(&R) -> T,
) -> Result<Vec<T>> {
    let mut cap = first;
    loop {
        let mut rows: Vec<R> = Vec::with_capacity(cap);
        let mut n = cap;
        let ret = fill(rows.as_mut_ptr(), &mut n);
        if ret == -libc::ERANGE && n > cap {
            cap = n;
            continue;
        }
        check(&what, ret)?;
        let n = n.min(cap);
        // SAFETY: librbd initialised the first `n` entries.
        unsafe { rows.set_len(n) };
        let out = rows.iter().map(&convert).collect();
        // SAFETY: the entries librbd filled, handed back once.
        unsafe { cleanup(rows.as_mut_ptr(), n) };
        return Ok(out);
    }
}

/// errno values on which a kept connection is given up.
fn connection_lost(errno: i32) -> bool {
    matches!(
        errno,
        libc::ETIMEDOUT | libc::ESHUTDOWN | libc::ENOTCONN | libc::ECONNREFUSED
    )
}

/// A librbd/librados failure (`-errno`), judged by its errno like the
/// command line's exit status.
fn failure(what: &str, ret: c_int) -> Error {
    let errno = -ret;
    let text = format!("{what}: {}", std::io::Error::from_raw_os_error(errno));
    let err = match errno {
        libc::ENOENT => Error::not_found(text),
        libc::EEXIST => Error::already_exists(text),
        libc::EACCES | libc::EPERM => {
            Error::invalid(format!("the cluster refused the credentials: {text}"))
        }
        e if connection_lost(e) => Error::unavailable(text),
        _ => Error::internal(text),
    };
    Error {
        os_error: Some(errno),
        ..err
    }
}

fn check(what: impl FnOnce() -> String, ret: c_int) -> Result<c_int> {
    if ret < 0 {
        Err(failure(&what(), ret))
    } else {
        Ok(ret)
    }
}

/// One cluster connection (a `rados_t`), shut down when the last call
/// holding it is done.
struct Connection {
    api: &'static Api,
    handle: Rados,
    /// When a call last used it ([`now_ms`]'s clock).
    used: std::sync::atomic::AtomicU64,
}

// SAFETY: a rados_t is safe to use from any thread and from several at
// once (librados's documented contract); it is only shut down in Drop,
// when no call holds it.
unsafe impl Send for Connection {}
unsafe impl Sync for Connection {}

impl Drop for Connection {
    fn drop(&mut self) {
        // SAFETY: the handle came from rados_create2 and is shut down once.
        unsafe { (self.api.rados_shutdown)(self.handle) }
    }
}

/// How long librados waits, and the outer deadline of a call.
const MOUNT_TIMEOUT: &str = "20";
const OP_TIMEOUT: &str = "30";
const DEADLINE: Duration = Duration::from_secs(90);
/// Copies (flatten) take their time.
const LONG: Duration = Duration::from_secs(3600);
/// Kept connections: at most this many users and keys, dropped after this
/// long unused.
const KEPT: usize = 8;
const IDLE: Duration = Duration::from_secs(600);
/// A connection unused this long catches up with the cluster's OSD map
/// before its next call. An idle client's map falls behind (a client is
/// only sent maps when it asks or sends an op). When it is further behind
/// than an OSD shares at once (40 epochs by default: snapshots and pg_num
/// changes each make some), librados can miss the epochs between and wait
/// for its 10 s "laggy op" check before it sends again; an op the OSD
/// dropped for a placement change (a pg_num change) waits that long. At
/// the monitors' pace (about an epoch a second) 5 s is far from 40 epochs.
const FRESH: Duration = Duration::from_secs(5);
/// A cluster call that takes longer is logged (a snapshot's monitor commit
/// takes about a second).
const SLOW: Duration = Duration::from_secs(5);

impl Connection {
    fn open(api: &'static Api, monitors: &str, user: &str, key: &str) -> Result<Connection> {
        let cluster = cstr("cluster", "ceph")?;
        let name = cstr("user", &format!("client.{user}"))?;
        let mut handle: Rados = std::ptr::null_mut();
        // SAFETY: valid out pointer and NUL-terminated names.
        check(|| "rados_create2".into(), unsafe {
            (api.rados_create2)(&mut handle, cluster.as_ptr(), name.as_ptr(), 0)
        })?;
        let conn = Connection {
            api,
            handle,
            used: now_ms().into(),
        };
        let settings = [
            ("mon_host", monitors),
            ("key", key),
            // No files of the host's, nothing printed, no admin socket.
            ("keyring", ""),
            ("log_to_stderr", "false"),
            ("err_to_stderr", "false"),
            ("log_file", ""),
            ("admin_socket", ""),
            ("client_mount_timeout", MOUNT_TIMEOUT),
            ("rados_mon_op_timeout", OP_TIMEOUT),
            ("rados_osd_op_timeout", OP_TIMEOUT),
            ("rbd_default_clone_format", "2"),
        ];
        for (option, value) in settings {
            let o = cstr("option", option)?;
            let v = cstr(option, value)?;
            // SAFETY: a live handle, NUL-terminated strings (copied by
            // librados).
            let ret = unsafe { (api.rados_conf_set)(conn.handle, o.as_ptr(), v.as_ptr()) };
            // The key's value is never part of an error.
            check(|| format!("rados_conf_set {option}"), ret)?;
        }
        // SAFETY: a configured handle, connected once.
        let ret = unsafe { (api.rados_connect)(conn.handle) };
        if ret == -libc::EINVAL {
            // librados could not use what it was given: the key (the
            // monitors were checked at start).
            return Err(Error {
                os_error: Some(libc::EINVAL),
                ..Error::invalid("the cluster library refused the key: not a cephx key")
            });
        }
        check(|| "connect to the cluster".into(), ret)?;
        Ok(conn)
    }

    /// Catches up with the cluster's OSD map (one monitor round trip, and
    /// the maps it lacks) when no call used the connection for `FRESH`.
    fn fresh(&self) -> Result<()> {
        let now = now_ms();
        let last = self.used.swap(now, std::sync::atomic::Ordering::Relaxed);
        if now.saturating_sub(last) < FRESH.as_millis() as u64 {
            return Ok(());
        }
        // SAFETY: a connected handle.
        check(|| "catch up with the cluster's map".into(), unsafe {
            (self.api.rados_wait_for_latest_osdmap)(self.handle)
        })
        .map(|_| ())
    }

    /// An I/O context on `place`'s pool and namespace.
    fn ioctx(&self, place: &Spec) -> Result<Ctx<'_>> {
        let pool = cstr("pool", &place.pool)?;
        let mut io: IoCtx = std::ptr::null_mut();
        // SAFETY: a connected handle, NUL-terminated name, valid out pointer.
        check(|| format!("pool {}", place.pool), unsafe {
            (self.api.rados_ioctx_create)(self.handle, pool.as_ptr(), &mut io)
        })?;
        let ctx = Ctx { conn: self, io };
        let ns = cstr("namespace", &place.namespace)?;
        // SAFETY: a live ioctx; the namespace is copied.
        unsafe { (self.api.rados_ioctx_set_namespace)(ctx.io, ns.as_ptr()) };
        Ok(ctx)
    }

    /// A monitor command's output.
    fn mon_command(&self, json: &str) -> Result<String> {
        let cmd = cstr("command", json)?;
        let mut cmds = [cmd.as_ptr()];
        let (mut out, mut out_len) = (std::ptr::null_mut(), 0usize);
        let (mut status, mut status_len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: one NUL-terminated command, no input, valid out pointers;
        // the buffers librados returns are freed with rados_buffer_free.
        let ret = unsafe {
            (self.api.rados_mon_command)(
                self.handle,
                cmds.as_mut_ptr(),
                1,
                std::ptr::null(),
                0,
                &mut out,
                &mut out_len,
                &mut status,
                &mut status_len,
            )
        };
        let text = if out.is_null() {
            String::new()
        } else {
            // SAFETY: out_len bytes at out, from librados.
            let bytes = unsafe { std::slice::from_raw_parts(out as *const u8, out_len) };
            String::from_utf8_lossy(bytes).into_owned()
        };
        for b in [out, status] {
            if !b.is_null() {
                // SAFETY: a buffer librados allocated.
                unsafe { (self.api.rados_buffer_free)(b) };
            }
        }
        check(|| "monitor command".into(), ret)?;
        Ok(text)
    }
}

/// An I/O context, destroyed when dropped.
struct Ctx<'a> {
    conn: &'a Connection,
    io: IoCtx,
}

impl Drop for Ctx<'_> {
    fn drop(&mut self) {
        // SAFETY: created by rados_ioctx_create, destroyed once.
        unsafe { (self.conn.api.rados_ioctx_destroy)(self.io) }
    }
}

/// An open image, closed when dropped.
struct Img<'a> {
    api: &'static Api,
    image: Image,
    spec: &'a Spec,
}

impl Drop for Img<'_> {
    fn drop(&mut self) {
        // SAFETY: opened by rbd_open*, closed once.
        unsafe { (self.api.rbd_close)(self.image) };
    }
}

/// Image options, destroyed when dropped.
struct Opts {
    api: &'static Api,
    opts: Options,
}

// SAFETY: the options are plain data owned by this value, used by one
// thread at a time (built here, read by the call on the blocking pool).
unsafe impl Send for Opts {}

impl Drop for Opts {
    fn drop(&mut self) {
        // SAFETY: created by rbd_image_options_create, destroyed once.
        unsafe { (self.api.rbd_image_options_destroy)(self.opts) }
    }
}

impl Opts {
    fn ptr(&self) -> Options {
        self.opts
    }
    fn new(api: &'static Api) -> Opts {
        let mut opts: Options = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        unsafe { (api.rbd_image_options_create)(&mut opts) };
        Opts { api, opts }
    }
    fn layout(self, layout: Layout<'_>) -> Result<Opts> {
        let bits = feature_bits(layout.features)?;
        // SAFETY: live options; option ids from librbd.h.
        check(|| "image option features".into(), unsafe {
            (self.api.rbd_image_options_set_uint64)(self.opts, OPT_FEATURES, bits)
        })?;
        if !layout.data_pool.is_empty() {
            let pool = cstr("data pool", layout.data_pool)?;
            // SAFETY: as above; the string is copied.
            check(|| "image option data_pool".into(), unsafe {
                (self.api.rbd_image_options_set_string)(self.opts, OPT_DATA_POOL, pool.as_ptr())
            })?;
        }
        Ok(self)
    }
}

impl Ctx<'_> {
    fn api(&self) -> &'static Api {
        self.conn.api
    }

    fn open<'s>(&self, spec: &'s Spec, write: bool) -> Result<Img<'s>> {
        let name = cstr("image", &spec.image)?;
        let mut image: Image = std::ptr::null_mut();
        let f = if write {
            self.api().rbd_open
        } else {
            self.api().rbd_open_read_only
        };
        // SAFETY: a live ioctx, NUL-terminated name, no snapshot.
        check(|| format!("open image {}", spec.arg()), unsafe {
            f(self.io, name.as_ptr(), &mut image, std::ptr::null())
        })?;
        Ok(Img {
            api: self.api(),
            image,
            spec,
        })
    }

    /// The image read-only at its snapshot `snap`.
    fn open_at<'s>(&self, spec: &'s Spec, snap: &str) -> Result<Img<'s>> {
        let name = cstr("image", &spec.image)?;
        let at = cstr("snapshot", snap)?;
        let mut image: Image = std::ptr::null_mut();
        // SAFETY: a live ioctx, NUL-terminated names.
        check(|| format!("open image {}@{snap}", spec.arg()), unsafe {
            (self.api().rbd_open_read_only)(self.io, name.as_ptr(), &mut image, at.as_ptr())
        })?;
        Ok(Img {
            api: self.api(),
            image,
            spec,
        })
    }

    /// Whether the image exists: its id object (`rbd_id.<name>`, where
    /// format 2 images have kept their id since 2012) read by one OSD op,
    /// without the cost of opening an image.
    fn exists(&self, spec: &Spec) -> Result<bool> {
        let object = cstr("image", &format!("rbd_id.{}", spec.image))?;
        let (mut size, mut mtime) = (0u64, 0 as libc::time_t);
        // SAFETY: a live ioctx, NUL-terminated name, valid out pointers.
        let ret =
            unsafe { (self.api().rados_stat)(self.io, object.as_ptr(), &mut size, &mut mtime) };
        if ret == -libc::ENOENT {
            return Ok(false);
        }
        check(|| format!("look up {}", spec.arg()), ret).map(|_| true)
    }

    /// The image's id, from its id object (a length-prefixed string).
    fn image_id(&self, spec: &Spec) -> Result<String> {
        let object = cstr("image", &format!("rbd_id.{}", spec.image))?;
        let mut buf = [0u8; 128];
        // SAFETY: a live ioctx, a buffer of the length given.
        let n = check(|| format!("look up {}", spec.arg()), unsafe {
            (self.api().rados_read)(
                self.io,
                object.as_ptr(),
                buf.as_mut_ptr() as *mut c_char,
                buf.len(),
                0,
            )
        })? as usize;
        decode_string(&buf[..n.min(buf.len())])
            .ok_or_else(|| Error::internal(format!("{}: an id object of another form", spec.arg())))
    }

    /// Sets metadata keys of an image nobody has open (one being made:
    /// under its temporary name, or its making on record) in one operation
    /// on its header: the `rbd` object class's `metadata_set`, which
    /// librbd's own call runs after opening the image (an open costs about
    /// 3 ms of CPU: its configuration is copied) and then tells every
    /// client that has it open. Only for images no client has open. With
    /// `clear_others`, the `ferrovol.` keys not in `set` (a clone comes
    /// with its parent's keys) are removed first, the same way.
    fn set_meta_unopened(
        &self,
        spec: &Spec,
        set: &[(String, String)],
        clear_others: bool,
    ) -> Result<()> {
        let header = format!("rbd_header.{}", self.image_id(spec)?);
        let said = |e: Error| Error {
            message: format!("set metadata of {}: {}", spec.arg(), e.message),
            ..e
        };
        if clear_others {
            for key in self.meta_of(&header)?.into_keys() {
                if key.starts_with("ferrovol.") && !set.iter().any(|(k, _)| *k == key) {
                    let mut input = Vec::new();
                    encode_string(&mut input, key.as_bytes());
                    self.class_call(&header, "metadata_remove", &input, &mut [])
                        .map_err(said)?;
                }
            }
        }
        self.class_call(&header, "metadata_set", &encode_metadata(set), &mut [])
            .map(|_| ())
            .map_err(said)
    }

    /// Runs method `method` of the `rbd` object class on `object`; the
    /// output's length.
    fn class_call(
        &self,
        object: &str,
        method: &str,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<usize> {
        let (o, class, m) = (
            cstr("object", object)?,
            cstr("class", "rbd")?,
            cstr("method", method)?,
        );
        // SAFETY: a live ioctx, NUL-terminated names, buffers of the
        // lengths given.
        check(|| format!("{method} on {object}"), unsafe {
            (self.api().rados_exec)(
                self.io,
                o.as_ptr(),
                class.as_ptr(),
                m.as_ptr(),
                input.as_ptr() as *const c_char,
                input.len(),
                out.as_mut_ptr() as *mut c_char,
                out.len(),
            )
        })
        .map(|n| n as usize)
    }

    /// The metadata the `rbd` class keeps on `object` (an image's header,
    /// or the record of images being made); none when there is no object.
    fn meta_of(&self, object: &str) -> Result<BTreeMap<String, String>> {
        let mut all = BTreeMap::new();
        let mut after = String::new();
        loop {
            // metadata_list's input: the key to start after, and how many.
            let mut input = Vec::new();
            encode_string(&mut input, after.as_bytes());
            input.extend_from_slice(&64u64.to_le_bytes());
            let mut out = vec![0u8; 64 * 1024];
            let n = match self.class_call(object, "metadata_list", &input, &mut out) {
                Err(e) if e.os_error == Some(libc::ENOENT) => return Ok(all),
                r => r?,
            };
            let page = decode_metadata(&out[..n]).ok_or_else(|| {
                Error::internal(format!("metadata of {object}: an unexpected form"))
            })?;
            let full = page.len() == 64;
            for (k, v) in page {
                after = k.clone();
                all.insert(k, v);
            }
            if !full {
                return Ok(all);
            }
        }
    }

    /// Runs a method of the `rbd` object class's metadata on the place's
    /// record of images being made (object `ferrovol.making`: a key per
    /// image, the CSI name it is made for).
    fn making(&self, method: &str, input: &[u8], out: &mut [u8]) -> Result<usize> {
        self.class_call(MAKING, method, input, out)
    }

    /// Removes `image` from the place's record of images being made.
    fn unintend(&self, image: &str) -> Result<()> {
        let mut key = Vec::new();
        encode_string(&mut key, image.as_bytes());
        match self.making("metadata_remove", &key, &mut []) {
            Err(e) if e.os_error == Some(libc::ENOENT) => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// Every image the place's record says is being made, with its CSI
    /// name (none when there is no record).
    fn being_made(&self) -> Result<BTreeMap<String, String>> {
        self.meta_of(MAKING)
    }

    fn list(&self) -> Result<Vec<(String, String)>> {
        let api = self.api();
        listing(
            || "list images".into(),
            64,
            // SAFETY: a live ioctx; room for `n` entries.
            |rows, n| unsafe { (api.rbd_list2)(self.io, rows, n) },
            api.rbd_image_spec_list_cleanup,
            |r: &ImageSpec| (owned(r.id), owned(r.name)),
        )
    }
}

impl Img<'_> {
    fn what(&self, op: &str) -> String {
        format!("{op} {}", self.spec.arg())
    }

    fn size(&self) -> Result<u64> {
        let mut size = 0u64;
        // SAFETY: an open image, valid out pointer.
        check(|| self.what("size of"), unsafe {
            (self.api.rbd_get_size)(self.image, &mut size)
        })?;
        Ok(size)
    }

    fn parent(&self) -> Result<Option<Parent>> {
        // SAFETY: zeroed structs are valid "empty" ones for librbd to fill.
        let mut image: LinkedImageSpec = unsafe { std::mem::zeroed() };
        let mut snap: SnapSpec = unsafe { std::mem::zeroed() };
        // SAFETY: an open image and valid out pointers.
        let ret = unsafe { (self.api.rbd_get_parent)(self.image, &mut image, &mut snap) };
        if ret == -libc::ENOENT {
            return Ok(None);
        }
        check(|| self.what("parent of"), ret)?;
        let parent = Parent {
            pool: owned(image.pool_name),
            pool_namespace: owned(image.pool_namespace),
            image: owned(image.image_name),
            snapshot: owned(snap.name),
        };
        // SAFETY: filled by rbd_get_parent, freed once.
        unsafe {
            (self.api.rbd_linked_image_spec_cleanup)(&mut image);
            (self.api.rbd_snap_spec_cleanup)(&mut snap);
        }
        Ok(Some(parent))
    }

    fn info(&self) -> Result<Info> {
        Ok(Info {
            size: self.size()?,
            parent: self.parent()?,
        })
    }

    fn meta(&self) -> Result<BTreeMap<String, String>> {
        let (mut keys_cap, mut vals_cap) = (4096usize, 4096usize);
        let start = cstr("start", "")?;
        loop {
            let mut keys = vec![0u8; keys_cap];
            let mut vals = vec![0u8; vals_cap];
            let (mut kl, mut vl) = (keys_cap, vals_cap);
            // SAFETY: buffers of the lengths given; librbd writes within.
            let ret = unsafe {
                (self.api.rbd_metadata_list)(
                    self.image,
                    start.as_ptr(),
                    0,
                    keys.as_mut_ptr() as *mut c_char,
                    &mut kl,
                    vals.as_mut_ptr() as *mut c_char,
                    &mut vl,
                )
            };
            if ret == -libc::ERANGE && (kl > keys_cap || vl > vals_cap) {
                keys_cap = kl.max(keys_cap);
                vals_cap = vl.max(vals_cap);
                continue;
            }
            check(|| self.what("metadata of"), ret)?;
            // Keys and values, each ended by a NUL; values may be empty.
            let parts = |b: &[u8], len: usize| -> Vec<String> {
                let mut v: Vec<String> = b[..len.min(b.len())]
                    .split(|c| *c == 0)
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect();
                v.pop();
                v
            };
            let k: Vec<String> = parts(&keys, kl)
                .into_iter()
                .filter(|k| !k.is_empty())
                .collect();
            let values = parts(&vals, vl);
            return Ok(k.into_iter().zip(values).collect());
        }
    }

    fn set_meta(&self, key: &str, value: &str) -> Result<()> {
        let k = cstr("metadata key", key)?;
        let v = cstr("metadata value", value)?;
        // SAFETY: an image open for writing, NUL-terminated strings.
        check(|| self.what("set metadata of"), unsafe {
            (self.api.rbd_metadata_set)(self.image, k.as_ptr(), v.as_ptr())
        })
        .map(|_| ())
    }

    fn remove_meta(&self, key: &str) -> Result<()> {
        let k = cstr("metadata key", key)?;
        // SAFETY: as above.
        match check(|| self.what("remove metadata of"), unsafe {
            (self.api.rbd_metadata_remove)(self.image, k.as_ptr())
        }) {
            Ok(_) => Ok(()),
            Err(e) if e.os_error == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn features(&self) -> Result<u64> {
        let mut bits = 0u64;
        // SAFETY: an open image, valid out pointer.
        check(|| self.what("features of"), unsafe {
            (self.api.rbd_get_features)(self.image, &mut bits)
        })?;
        Ok(bits)
    }

    /// Every snapshot of the image (all namespaces): id and name.
    fn snap_list(&self) -> Result<Vec<(u64, String)>> {
        let mut cap: c_int = 16;
        loop {
            let mut rows: Vec<SnapInfo> = Vec::with_capacity(cap as usize);
            let mut n = cap;
            // SAFETY: an open image; room for `n` entries (the list ends
            // with an entry of its own).
            let ret = unsafe { (self.api.rbd_snap_list)(self.image, rows.as_mut_ptr(), &mut n) };
            if ret == -libc::ERANGE && n > cap {
                cap = n;
                continue;
            }
            let count = check(|| self.what("snapshots of"), ret)? as usize;
            // SAFETY: librbd filled `count` entries and the end marker.
            unsafe { rows.set_len(count) };
            let out = rows.iter().map(|r| (r.id, owned(r.name))).collect();
            // SAFETY: the list librbd filled, handed back once.
            unsafe { (self.api.rbd_snap_list_end)(rows.as_mut_ptr()) };
            return Ok(out);
        }
    }

    fn snap_namespace(&self, id: u64) -> Result<c_int> {
        let mut kind: c_int = 0;
        // SAFETY: an open image, a snapshot id it listed, out pointer.
        check(|| self.what("snapshot namespace of"), unsafe {
            (self.api.rbd_snap_get_namespace_type)(self.image, id, &mut kind)
        })?;
        Ok(kind)
    }

    /// The group of ours (`fvg-`, in the image's own pool) that holds it:
    /// only a group snapshot cut short leaves one.
    fn leftover_group(&self, ctx: &Ctx<'_>) -> Result<Option<String>> {
        let api = self.api;
        // SAFETY: zeroed is the empty struct librbd fills.
        let mut info: GroupInfo = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<GroupInfo>();
        // SAFETY: an open image, the struct's size given.
        check(|| self.what("group of"), unsafe {
            (api.rbd_get_group)(self.image, &mut info, size)
        })?;
        let name = owned(info.name);
        // SAFETY: a live ioctx.
        let here = unsafe { (api.rados_ioctx_get_id)(ctx.io) };
        let pool = info.pool;
        // SAFETY: filled above, freed once.
        unsafe { (api.rbd_group_info_cleanup)(&mut info, size) };
        Ok((name.starts_with("fvg-") && pool == here).then_some(name))
    }

    /// The names of the image's user snapshots.
    fn user_snaps(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for (id, name) in self.snap_list()? {
            if self.snap_namespace(id)? == SNAP_NAMESPACE_USER {
                out.push(name);
            }
        }
        Ok(out)
    }

    /// The id of the image's snapshot that the group `group`'s snapshot
    /// made (in the group namespace, where no name reaches it).
    fn group_snap_id(&self, group: &str) -> Result<u64> {
        let snaps = self.snap_list()?;
        for (id, _) in snaps {
            if self.snap_namespace(id)? != SNAP_NAMESPACE_GROUP {
                continue;
            }
            // SAFETY: zeroed is the empty struct librbd fills.
            let mut ns: GroupNamespace = unsafe { std::mem::zeroed() };
            let size = std::mem::size_of::<GroupNamespace>();
            // SAFETY: as above; the struct's size given.
            check(|| self.what("group of a snapshot of"), unsafe {
                (self.api.rbd_snap_get_group_namespace)(self.image, id, &mut ns, size)
            })?;
            let name = owned(ns.group_name);
            // SAFETY: filled above, freed once.
            unsafe { (self.api.rbd_snap_group_namespace_cleanup)(&mut ns, size) };
            if name == group {
                return Ok(id);
            }
        }
        Err(Error::internal(format!(
            "{} holds no snapshot of group {group}",
            self.spec.arg()
        )))
    }

    /// One page of the exact extents from `start` holding data (with the
    /// parent's), or changed since snapshot `from`.
    fn diff(&self, from: Option<&str>, start: u64, max: usize) -> Result<DiffPage> {
        let size = self.size()?;
        let mut pager = Pager::new(start, max);
        if start < size {
            let from = from.map(|f| cstr("snapshot", f)).transpose()?;
            let from_ptr = from.as_ref().map_or(std::ptr::null(), |f| f.as_ptr());
            // SAFETY: an open image; `pager` outlives the walk, which
            // calls back on this thread only; exact extents, parent's too.
            let ret = unsafe {
                (self.api.rbd_diff_iterate2)(
                    self.image,
                    from_ptr,
                    start,
                    size - start,
                    1,
                    0,
                    Some(take_extent),
                    &mut pager as *mut Pager as *mut c_void,
                )
            };
            if ret != -libc::ECANCELED {
                check(|| self.what("diff of"), ret)?;
            }
        }
        Ok(pager.done())
    }

    fn watchers(&self) -> Result<Vec<String>> {
        listing(
            || self.what("watchers of"),
            8,
            // SAFETY: an open image; room for `n` entries.
            |rows, n| unsafe { (self.api.rbd_watchers_list)(self.image, rows, n) },
            self.api.rbd_watchers_list_cleanup,
            |w: &WatcherInfo| owned(w.addr),
        )
    }

    fn name_op(
        &self,
        op: &str,
        f: unsafe extern "C" fn(Image, *const c_char) -> c_int,
        snap: &str,
    ) -> Result<()> {
        let s = cstr("snapshot", snap)?;
        // SAFETY: an image open for writing, NUL-terminated name.
        check(|| format!("{op} {}@{snap}", self.spec.arg()), unsafe {
            f(self.image, s.as_ptr())
        })
        .map(|_| ())
    }
}

/// The connections kept: per user and key (by digest; the key itself is
/// only in librados).
#[derive(Default)]
struct Pool {
    kept: HashMap<[u8; 32], Kept>,
}

struct Kept {
    conn: Arc<tokio::sync::OnceCell<Arc<Connection>>>,
    used: Instant,
}

/// librbd on kept connections, against one cluster.
pub struct LibCluster {
    api: &'static Api,
    monitors: String,
    pool: Mutex<Pool>,
    /// Trash entries (image ids) whose data a background task is removing,
    /// with the parent each holds open meanwhile.
    removing: Arc<Mutex<HashMap<String, Option<Spec>>>>,
    /// Images made in place whose record of making a background task is
    /// removing (a delete of one waits for it).
    unintending: Arc<Mutex<Vec<Spec>>>,
}

impl LibCluster {
    pub fn new(monitors: &[String]) -> std::result::Result<LibCluster, String> {
        Ok(LibCluster {
            api: api()?,
            monitors: monitors.join(","),
            pool: Mutex::new(Pool::default()),
            removing: Default::default(),
            unintending: Default::default(),
        })
    }

    fn digest(creds: &Creds) -> Result<[u8; 32]> {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(creds.user.as_bytes());
        h.update([0]);
        h.update(creds.key()?.as_bytes());
        Ok(h.finalize().into())
    }

    /// The kept connection for these credentials, made when there is none
    /// (one attempt at a time per user and key).
    async fn connection(&self, creds: &Creds) -> Result<Arc<Connection>> {
        let id = Self::digest(creds)?;
        let cell = {
            let mut pool = self.pool.locked();
            let now = Instant::now();
            pool.kept
                .retain(|k, kept| *k == id || now.duration_since(kept.used) < IDLE);
            if !pool.kept.contains_key(&id) && pool.kept.len() >= KEPT {
                if let Some(oldest) = pool
                    .kept
                    .iter()
                    .min_by_key(|(_, k)| k.used)
                    .map(|(k, _)| *k)
                {
                    pool.kept.remove(&oldest);
                }
            }
            let kept = pool.kept.entry(id).or_insert_with(|| Kept {
                conn: Default::default(),
                used: now,
            });
            kept.used = now;
            kept.conn.clone()
        };
        let conn = cell
            .get_or_try_init(|| async {
                let (api, monitors) = (self.api, self.monitors.clone());
                let (user, key) = (creds.user.clone(), creds.key()?.to_string());
                blocking(DEADLINE, move || {
                    Connection::open(api, &monitors, &user, &key)
                })
                .await
                .map(Arc::new)
            })
            .await;
        if conn.is_err() {
            self.forget(id, None);
        }
        conn.cloned()
    }

    /// Drops the kept connection `id` (only `conn`, when given: not one a
    /// later call already made anew).
    fn forget(&self, id: [u8; 32], conn: Option<&Arc<Connection>>) {
        let mut pool = self.pool.locked();
        let same = pool
            .kept
            .get(&id)
            .is_some_and(|k| match (conn, k.conn.get()) {
                (Some(c), Some(kept)) => Arc::ptr_eq(c, kept),
                (None, _) => true,
                (Some(_), None) => false,
            });
        if same {
            pool.kept.remove(&id);
        }
    }

    /// Runs `f` on a kept connection, off the async workers; a connection
    /// that failed this way is given up.
    async fn call<T: Send + 'static, F: FnOnce(&Connection) -> Result<T> + Send + 'static>(
        &self,
        creds: &Creds,
        deadline: Duration,
        f: F,
    ) -> Result<T> {
        let asked = Instant::now();
        let conn = self.connection(creds).await?;
        let held = conn.clone();
        let connected = asked.elapsed();
        let r = blocking(deadline, move || {
            held.fresh()?;
            f(&held)
        })
        .await;
        let took = asked.elapsed();
        if took > SLOW {
            // Which call: the closure's type names the method it is in.
            let call = std::any::type_name::<F>();
            let call = call.split("::{{closure}}").next().unwrap_or(call);
            let call = call.rsplit("::").next().unwrap_or(call);
            tracing::warn!(
                call,
                ms = took.as_millis() as u64,
                connecting_ms = connected.as_millis() as u64,
                "a cluster call was slow"
            );
        }
        if let Err(e) = &r {
            if e.kind == Kind::Unavailable || e.os_error.is_some_and(connection_lost) {
                tracing::info!(error = %e.message, "giving up the cluster connection");
                self.forget(Self::digest(creds)?, Some(&conn));
            }
        }
        r
    }

    /// Removes the record that `spec` is being made, in the background,
    /// on the kept connection: the image has its CSI name, so the record no
    /// longer says anything (a driver that dies first leaves it for the
    /// image's delete, or for a retry, to remove).
    async fn unintend_later(&self, creds: &Creds, spec: &Spec) {
        let Ok(conn) = self.connection(creds).await else {
            // The image is whole; its record goes with its delete.
            return;
        };
        self.unintending.locked().push(spec.clone());
        let (unintending, spec) = (self.unintending.clone(), spec.clone());
        tokio::task::spawn_blocking(move || {
            crate::killpoint::hit(super::KillPoint::Named);
            let removed = conn.ioctx(&spec).and_then(|ctx| ctx.unintend(&spec.image));
            match removed {
                Ok(()) => tracing::debug!(image = %spec.arg(), "record of making removed"),
                Err(e) => {
                    tracing::debug!(image = %spec.arg(), error = %e.message, "record of making left")
                }
            }
            unintending.locked().retain(|s| *s != spec);
        });
    }

    /// Runs `f` on an I/O context of `place`.
    async fn on<T: Send + 'static>(
        &self,
        creds: &Creds,
        place: &Spec,
        f: impl FnOnce(&Ctx<'_>) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let place = place.clone();
        self.call(creds, DEADLINE, move |c| f(&c.ioctx(&place)?))
            .await
    }

    /// Runs `f` on the image `spec` names, opened for writing or not.
    async fn image<T: Send + 'static>(
        &self,
        creds: &Creds,
        spec: &Spec,
        write: bool,
        deadline: Duration,
        f: impl FnOnce(&Img<'_>) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let spec = spec.clone();
        self.call(creds, deadline, move |c| {
            let ctx = c.ioctx(&spec)?;
            let img = ctx.open(&spec, write)?;
            f(&img)
        })
        .await
    }
}

/// Milliseconds since the first time asked: a clock for connections'
/// idleness.
fn now_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// `f` on the blocking pool, answered within `deadline` (the thread itself
/// ends when librados's own timeouts end the call).
async fn blocking<T: Send + 'static>(
    deadline: Duration,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::time::timeout(deadline, tokio::task::spawn_blocking(f)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(Error::internal(format!("a cluster call failed: {e}"))),
        Err(_) => Err(Error::unavailable(format!(
            "the cluster did not answer within {} s",
            deadline.as_secs()
        ))),
    }
}

fn not_found_none<T>(r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.os_error == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

#[async_trait::async_trait]
impl Cluster for LibCluster {
    fn client(&self) -> &'static str {
        "librbd"
    }

    async fn info(&self, creds: &Creds, spec: &Spec) -> Result<Option<Info>> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            if !ctx.exists(&s)? {
                return Ok(None);
            }
            not_found_none(ctx.open(&s, false).and_then(|img| img.info()))
        })
        .await
    }

    async fn describe(
        &self,
        creds: &Creds,
        spec: &Spec,
    ) -> Result<Option<(Info, BTreeMap<String, String>)>> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            if !ctx.exists(&s)? {
                return Ok(None);
            }
            not_found_none(
                ctx.open(&s, false)
                    .and_then(|img| Ok((img.info()?, img.meta()?))),
            )
        })
        .await
    }

    async fn inspect(&self, creds: &Creds, spec: &Spec) -> Result<Option<Inspected>> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            if !ctx.exists(&s)? {
                return Ok(None);
            }
            not_found_none(ctx.open(&s, false).and_then(|img| {
                Ok(Inspected {
                    info: img.info()?,
                    meta: img.meta()?,
                    watchers: img.watchers()?,
                    group: img.leftover_group(ctx)?,
                    snaps: img.user_snaps()?,
                })
            }))
        })
        .await
    }

    async fn meta(&self, creds: &Creds, spec: &Spec) -> Result<BTreeMap<String, String>> {
        self.image(creds, spec, false, DEADLINE, |img| img.meta())
            .await
    }

    async fn set_meta(&self, creds: &Creds, spec: &Spec, key: &str, value: &str) -> Result<()> {
        let (k, v) = (key.to_string(), value.to_string());
        self.image(creds, spec, true, DEADLINE, move |img| img.set_meta(&k, &v))
            .await
    }

    async fn remove_meta(&self, creds: &Creds, spec: &Spec, key: &str) -> Result<()> {
        let k = key.to_string();
        match self
            .image(creds, spec, true, DEADLINE, move |img| img.remove_meta(&k))
            .await
        {
            Err(e) if e.os_error == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    }

    fn makes_in_place(&self) -> bool {
        true
    }

    async fn intend(&self, creds: &Creds, spec: &Spec, name: &str) -> Result<()> {
        let (image, name) = (spec.image.clone(), name.to_string());
        self.on(creds, spec, move |ctx| {
            ctx.making("metadata_set", &encode_metadata(&[(image, name)]), &mut [])
                .map(|_| ())
        })
        .await
    }

    async fn unintend(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        let image = spec.image.clone();
        self.on(creds, spec, move |ctx| ctx.unintend(&image)).await
    }

    async fn intended(&self, creds: &Creds, place: &Spec) -> Result<BTreeMap<String, String>> {
        self.on(creds, place, |ctx| ctx.being_made()).await
    }

    async fn finish(
        &self,
        creds: &Creds,
        tmp: &Spec,
        to: &Spec,
        set: &[(&str, &str)],
        clear_others: bool,
    ) -> Result<()> {
        // The metadata on the header (no open), then the rename; made in
        // place, the record of its making goes instead.
        let set: Vec<(String, String)> = set
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let in_place = tmp.image == to.image;
        let (from, dest) = (tmp.clone(), to.clone());
        self.call(creds, DEADLINE, move |c| {
            let ctx = c.ioctx(&from)?;
            // An image being made (a temporary one, or one whose making is
            // on record): nobody has it open. A copy's keys of its parent's
            // go first.
            ctx.set_meta_unopened(&from, &set, clear_others)?;
            if in_place {
                return Ok(());
            }
            let (f, d) = (cstr("image", &from.image)?, cstr("image", &dest.image)?);
            // SAFETY: a live ioctx, NUL-terminated names.
            check(
                || format!("rename {} to {}", from.arg(), dest.image),
                unsafe { (ctx.api().rbd_rename)(ctx.io, f.as_ptr(), d.as_ptr()) },
            )
            .map(|_| ())
        })
        .await?;
        if in_place {
            // Done now that it has its CSI name (a named image is whole
            // whatever its record says); the record goes in the background.
            self.unintend_later(creds, to).await;
        }
        Ok(())
    }

    async fn watchers(&self, creds: &Creds, spec: &Spec) -> Result<Vec<String>> {
        self.image(creds, spec, false, DEADLINE, |img| img.watchers())
            .await
    }

    async fn blocklist(&self, creds: &Creds, addr: &str, expire: u64) -> Result<()> {
        super::cluster::check_client_addr(addr)?;
        let cmd = serde_json::json!({
            "prefix": "osd blocklist",
            "blocklistop": "add",
            "addr": addr,
            "expire": expire as f64,
        })
        .to_string();
        self.call(creds, DEADLINE, move |c| c.mon_command(&cmd))
            .await
            .map(|_| ())
    }

    async fn list(&self, creds: &Creds, place: &Spec) -> Result<Vec<String>> {
        self.on(creds, place, |ctx| {
            Ok(ctx.list()?.into_iter().map(|(_, name)| name).collect())
        })
        .await
    }

    async fn sizes(&self, creds: &Creds, specs: &[Spec]) -> Result<Vec<Option<u64>>> {
        let specs = specs.to_vec();
        self.call(creds, DEADLINE, move |c| {
            let mut out = Vec::with_capacity(specs.len());
            for spec in &specs {
                let ctx = c.ioctx(spec)?;
                out.push(not_found_none(
                    ctx.open(spec, false).and_then(|i| i.size()),
                )?);
            }
            Ok(out)
        })
        .await
    }

    async fn namespaces(&self, creds: &Creds, pool: &str) -> Result<Vec<String>> {
        let place = Spec {
            pool: pool.into(),
            namespace: String::new(),
            image: String::new(),
        };
        self.on(creds, &place, |ctx| {
            let api = ctx.api();
            let mut cap = 1024usize;
            loop {
                let mut buf = vec![0u8; cap];
                let mut len = cap;
                // SAFETY: a buffer of `len` bytes.
                let ret = unsafe {
                    (api.rbd_namespace_list)(ctx.io, buf.as_mut_ptr() as *mut c_char, &mut len)
                };
                if ret == -libc::ERANGE && len > cap {
                    cap = len;
                    continue;
                }
                if ret == -libc::ENOENT {
                    return Ok(Vec::new());
                }
                check(|| "list namespaces".into(), ret)?;
                return Ok(buf[..len.min(cap)]
                    .split(|c| *c == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect());
            }
        })
        .await
    }

    async fn trash(&self, creds: &Creds, place: &Spec) -> Result<Vec<TrashEntry>> {
        self.on(creds, place, |ctx| {
            let api = ctx.api();
            listing(
                || "list the trash".into(),
                16,
                // SAFETY: a live ioctx; room for `n` entries.
                |rows, n| unsafe { (api.rbd_trash_list)(ctx.io, rows, n) },
                api.rbd_trash_list_cleanup,
                |t: &TrashInfo| TrashEntry {
                    id: owned(t.id),
                    name: owned(t.name),
                },
            )
        })
        .await
    }

    async fn trash_move(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            let name = cstr("image", &s.image)?;
            // SAFETY: a live ioctx, NUL-terminated name.
            check(|| format!("move {} to the trash", s.arg()), unsafe {
                (ctx.api().rbd_trash_move)(ctx.io, name.as_ptr(), 0)
            })
            .map(|_| ())
        })
        .await
    }

    async fn settle(&self, spec: &Spec) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline
            && (self
                .removing
                .locked()
                .values()
                .any(|p| p.as_ref() == Some(spec))
                || self.unintending.locked().contains(spec))
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn discard(&self, creds: &Creds, spec: &Spec, parent: Option<&Spec>) -> Result<()> {
        let s = spec.clone();
        // Out of the directory now: its id kept, then moved to the trash.
        let id = self
            .on(creds, spec, move |ctx| {
                let id = ctx.image_id(&s)?;
                let name = cstr("image", &s.image)?;
                // SAFETY: a live ioctx, NUL-terminated name.
                check(|| format!("move {} to the trash", s.arg()), unsafe {
                    (ctx.api().rbd_trash_move)(ctx.io, name.as_ptr(), 0)
                })?;
                Ok(id)
            })
            .await;
        let id = match id {
            Ok(id) => id,
            Err(e) if e.os_error == Some(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(e),
        };
        crate::killpoint::hit(super::KillPoint::Trashed);
        // Its data (every object of it) in the background, on the same
        // kept connection.
        let conn = self.connection(creds).await?;
        self.removing.locked().insert(id.clone(), parent.cloned());
        let (removing, place) = (self.removing.clone(), spec.clone());
        tokio::task::spawn_blocking(move || {
            let removed = conn.ioctx(&place).and_then(|ctx| {
                let i = cstr("trash id", &id)?;
                // SAFETY: a live ioctx, NUL-terminated id.
                check(|| format!("remove {id} from the trash"), unsafe {
                    (ctx.api().rbd_trash_remove)(ctx.io, i.as_ptr(), false)
                })
            });
            if let Err(e) = removed {
                // Clones need it (or the cluster failed): a later purge.
                tracing::debug!(image = %place.arg(), error = %e.message, "left in the trash");
            }
            let idle = {
                let mut removing = removing.locked();
                removing.remove(&id);
                removing.is_empty()
            };
            // A removal opens the image (librbd copies its configuration):
            // megabytes freed into this thread's arena, handed back once
            // no other removal runs.
            if idle {
                crate::host::return_free_memory();
            }
        });
        Ok(())
    }

    async fn trash_remove(&self, creds: &Creds, place: &Spec, id: &str) -> Result<()> {
        if self.removing.locked().contains_key(id) {
            return Err(Error::unavailable(format!(
                "{id} is being removed from the trash"
            )));
        }
        let id = id.to_string();
        self.on(creds, place, move |ctx| {
            let i = cstr("trash id", &id)?;
            // SAFETY: a live ioctx, NUL-terminated id.
            check(|| format!("remove {id} from the trash"), unsafe {
                (ctx.api().rbd_trash_remove)(ctx.io, i.as_ptr(), false)
            })
            .map(|_| ())
        })
        .await
    }

    async fn create(
        &self,
        creds: &Creds,
        spec: &Spec,
        size: u64,
        layout: Layout<'_>,
    ) -> Result<()> {
        let s = spec.clone();
        let opts = Opts::new(self.api).layout(layout)?;
        self.on(creds, spec, move |ctx| {
            let name = cstr("image", &s.image)?;
            // SAFETY: a live ioctx and options, NUL-terminated name.
            check(|| format!("create {}", s.arg()), unsafe {
                (ctx.api().rbd_create4)(ctx.io, name.as_ptr(), size, opts.ptr())
            })
            .map(|_| ())
        })
        .await
    }

    async fn clone_image(
        &self,
        creds: &Creds,
        parent: &Spec,
        snap: &str,
        to: &Spec,
        layout: Option<Layout<'_>>,
    ) -> Result<()> {
        let mut opts = Opts::new(self.api);
        if let Some(l) = layout {
            opts = opts.layout(l)?;
        }
        // SAFETY: live options; option id from librbd.h.
        check(|| "image option clone_format".into(), unsafe {
            (self.api.rbd_image_options_set_uint64)(opts.opts, OPT_CLONE_FORMAT, 2)
        })?;
        let (p, t, snap) = (parent.clone(), to.clone(), snap.to_string());
        self.call(creds, DEADLINE, move |c| {
            let (pctx, cctx) = (c.ioctx(&p)?, c.ioctx(&t)?);
            let (pn, sn, cn) = (
                cstr("image", &p.image)?,
                cstr("snapshot", &snap)?,
                cstr("image", &t.image)?,
            );
            // SAFETY: live ioctxs and options, NUL-terminated names.
            check(
                || format!("clone {}@{snap} to {}", p.arg(), t.arg()),
                unsafe {
                    (c.api.rbd_clone3)(
                        pctx.io,
                        pn.as_ptr(),
                        sn.as_ptr(),
                        cctx.io,
                        cn.as_ptr(),
                        opts.ptr(),
                    )
                },
            )
            .map(|_| ())
        })
        .await
    }

    async fn resize(&self, creds: &Creds, spec: &Spec, size: u64) -> Result<()> {
        self.image(creds, spec, true, DEADLINE, move |img| {
            // SAFETY: an image open for writing.
            check(|| img.what("resize"), unsafe {
                (img.api.rbd_resize)(img.image, size)
            })
            .map(|_| ())
        })
        .await
    }

    async fn flatten(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        self.image(creds, spec, true, LONG, |img| {
            // SAFETY: an image open for writing.
            check(|| img.what("flatten"), unsafe {
                (img.api.rbd_flatten)(img.image)
            })
            .map(|_| ())
        })
        .await
    }

    async fn remove(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            let name = cstr("image", &s.image)?;
            // SAFETY: a live ioctx, NUL-terminated name.
            check(|| format!("remove {}", s.arg()), unsafe {
                (ctx.api().rbd_remove)(ctx.io, name.as_ptr())
            })
            .map(|_| ())
        })
        .await
    }

    async fn rename(&self, creds: &Creds, from: &Spec, to: &Spec) -> Result<()> {
        let (f, t) = (from.clone(), to.image.clone());
        self.on(creds, from, move |ctx| {
            let (a, b) = (cstr("image", &f.image)?, cstr("image", &t)?);
            // SAFETY: a live ioctx, NUL-terminated names.
            check(|| format!("rename {} to {t}", f.arg()), unsafe {
                (ctx.api().rbd_rename)(ctx.io, a.as_ptr(), b.as_ptr())
            })
            .map(|_| ())
        })
        .await
    }

    async fn snap_create(&self, creds: &Creds, spec: &Spec, snap: &str) -> Result<()> {
        let snap = snap.to_string();
        self.image(creds, spec, true, DEADLINE, move |img| {
            img.name_op("snapshot", img.api.rbd_snap_create, &snap)
        })
        .await
    }

    async fn snap_remove(&self, creds: &Creds, spec: &Spec, snap: &str) -> Result<()> {
        let snap = snap.to_string();
        self.image(creds, spec, true, DEADLINE, move |img| {
            img.name_op("remove snapshot", img.api.rbd_snap_remove, &snap)
        })
        .await
    }

    async fn snaps(&self, creds: &Creds, spec: &Spec) -> Result<Vec<String>> {
        self.image(creds, spec, false, DEADLINE, |img| img.user_snaps())
            .await
    }

    async fn diff(
        &self,
        creds: &Creds,
        spec: &Spec,
        at: Option<&str>,
        from: Option<&str>,
        start: u64,
        max: usize,
    ) -> Result<DiffPage> {
        let (spec, at, from) = (
            spec.clone(),
            at.map(str::to_string),
            from.map(str::to_string),
        );
        // Exact extents read every object's snapshot list: long on big
        // images.
        self.call(creds, LONG, move |c| {
            let ctx = c.ioctx(&spec)?;
            let img = match &at {
                Some(snap) => ctx.open_at(&spec, snap)?,
                None => ctx.open(&spec, false)?,
            };
            img.diff(from.as_deref(), start, max)
        })
        .await
    }

    async fn snap_together(&self, creds: &Creds, members: &[(Spec, String)]) -> Result<()> {
        let members = members.to_vec();
        self.call(creds, DEADLINE, move |c| {
            let ctxs = members
                .iter()
                .map(|(spec, _)| c.ioctx(spec))
                .collect::<Result<Vec<_>>>()?;
            let imgs = ctxs
                .iter()
                .zip(&members)
                .map(|(ctx, (spec, _))| ctx.open(spec, true))
                .collect::<Result<Vec<_>>>()?;
            let mut locked = Vec::new();
            let mut cut = Vec::new();
            let mut outcome = Ok(());
            for img in &imgs {
                // SAFETY: an image open for writing; 0 is RBD_LOCK_MODE_EXCLUSIVE.
                let ret = unsafe { (img.api.rbd_lock_acquire)(img.image, 0) };
                if ret == -libc::EINVAL {
                    outcome = Err(Error::precondition(format!(
                        "{} has no exclusive-lock feature: nothing can hold its writes for \
                         a group snapshot (imageFeatures: layering,exclusive-lock)",
                        img.spec.arg()
                    )));
                    break;
                }
                if let Err(e) = check(|| img.what("take the exclusive lock of"), ret) {
                    // Another client holds it (a driver that died holding
                    // it does until the cluster times its watch out): the
                    // retry takes it.
                    outcome = Err(Error {
                        kind: crate::error::Kind::Unavailable,
                        ..e
                    });
                    break;
                }
                locked.push(img);
            }
            if outcome.is_ok() {
                for (img, (_, snap)) in imgs.iter().zip(&members) {
                    if let Err(e) = img.name_op("snapshot", img.api.rbd_snap_create, snap) {
                        outcome = Err(e);
                        break;
                    }
                    crate::killpoint::hit(super::KillPoint::GroupSnapped);
                    cut.push((img, snap));
                }
            }
            if outcome.is_err() {
                for (img, snap) in &cut {
                    let _ = img.name_op("remove snapshot", img.api.rbd_snap_remove, snap);
                }
            }
            for img in locked {
                // SAFETY: a lock this handle took.
                unsafe { (img.api.rbd_lock_release)(img.image) };
            }
            outcome
        })
        .await
    }

    async fn leftover_group(&self, creds: &Creds, spec: &Spec) -> Result<Option<String>> {
        let s = spec.clone();
        self.on(creds, spec, move |ctx| {
            ctx.open(&s, false)?.leftover_group(ctx)
        })
        .await
    }

    async fn group_remove(&self, creds: &Creds, place: &Spec, name: &str) -> Result<()> {
        let (p, name) = (place.clone(), name.to_string());
        self.on(creds, place, move |ctx| {
            let g = cstr("group", &name)?;
            // SAFETY: a live ioctx, a NUL-terminated name.
            check(
                || format!("remove rbd group {name} of {}", p.arg()),
                unsafe { (ctx.api().rbd_group_remove)(ctx.io, g.as_ptr()) },
            )
            .map(|_| ())
        })
        .await
    }

    async fn copy_together(
        &self,
        creds: &Creds,
        group: &Spec,
        members: &[(Spec, Spec)],
    ) -> Result<()> {
        let (group, members) = (group.clone(), members.to_vec());
        // Copies take as long as the members' data does.
        self.call(creds, LONG, move |c| {
            let api = c.api;
            let gctx = c.ioctx(&group)?;
            let gname = cstr("group", &group.image)?;
            let what = || format!("rbd group {}", group.arg());
            // SAFETY (each call below): a live ioctx, NUL-terminated names.
            let ret = unsafe { (api.rbd_group_create)(gctx.io, gname.as_ptr()) };
            if ret == -libc::EEXIST {
                // Ours (the name is this group snapshot's), left by an
                // attempt that did not finish: its cut is stale.
                check(what, unsafe {
                    (api.rbd_group_remove)(gctx.io, gname.as_ptr())
                })?;
                check(what, unsafe {
                    (api.rbd_group_create)(gctx.io, gname.as_ptr())
                })?;
            } else {
                check(what, ret)?;
            }
            let mut made = Vec::new();
            let outcome = (|| -> Result<()> {
                for (from, _) in &members {
                    let ctx = c.ioctx(from)?;
                    let img = ctx.open(from, false)?;
                    if img.features()? & FEATURE_EXCLUSIVE_LOCK == 0 {
                        return Err(Error::precondition(format!(
                            "{} has no exclusive-lock feature: nothing can hold its writes \
                             for a group snapshot (imageFeatures: layering,exclusive-lock)",
                            from.arg()
                        )));
                    }
                    let name = cstr("image", &from.image)?;
                    check(|| format!("add {} to {}", from.arg(), what()), unsafe {
                        (api.rbd_group_image_add)(gctx.io, gname.as_ptr(), ctx.io, name.as_ptr())
                    })?;
                }
                // Each member's exclusive lock is taken from its writers
                // (kernel clients wait for it to come back) while all are
                // snapshotted; quiesce requests go to clients that take
                // them.
                let snap = cstr("snapshot", "cut")?;
                check(|| format!("snapshot {}", what()), unsafe {
                    (api.rbd_group_snap_create2)(gctx.io, gname.as_ptr(), snap.as_ptr(), 0)
                })?;
                crate::killpoint::hit(super::KillPoint::GroupCut);
                for (from, to) in &members {
                    let ctx = c.ioctx(from)?;
                    let img = ctx.open(from, false)?;
                    let id = img.group_snap_id(&group.image)?;
                    check(|| img.what("open the group's snapshot of"), unsafe {
                        (api.rbd_snap_set_by_id)(img.image, id)
                    })?;
                    let tctx = c.ioctx(to)?;
                    let name = cstr("image", &to.image)?;
                    let opts = Opts::new(api);
                    check(
                        || format!("copy {} as cut to {}", from.arg(), to.arg()),
                        unsafe { (api.rbd_copy3)(img.image, tctx.io, name.as_ptr(), opts.opts) },
                    )?;
                    made.push(to.clone());
                }
                Ok(())
            })();
            if outcome.is_err() {
                for to in &made {
                    if let (Ok(ctx), Ok(name)) = (c.ioctx(to), cstr("image", &to.image)) {
                        unsafe { (api.rbd_remove)(ctx.io, name.as_ptr()) };
                    }
                }
            }
            // The group, its snapshot and the members' place in it go.
            let removed = check(|| format!("remove {}", what()), unsafe {
                (api.rbd_group_remove)(gctx.io, gname.as_ptr())
            });
            outcome.and(removed.map(|_| ()))
        })
        .await
    }

    async fn pool_available(&self, creds: &Creds, pool: &str) -> Result<u64> {
        let out = self
            .call(creds, DEADLINE, |c| {
                c.mon_command(r#"{"prefix":"df","detail":"detail","format":"json"}"#)
            })
            .await?;
        super::cluster::pool_available(&out, pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes cls_rbd's metadata_set decodes (Ceph's encoding: u32
    /// little-endian counts and lengths), and an id object read back.
    #[test]
    fn metadata_and_ids_in_cephs_encoding() {
        let set = [("ferrovol.name".to_string(), "pvc-1".to_string())];
        let mut want = vec![1, 0, 0, 0, 13, 0, 0, 0];
        want.extend_from_slice(b"ferrovol.name");
        want.extend_from_slice(&[5, 0, 0, 0]);
        want.extend_from_slice(b"pvc-1");
        assert_eq!(encode_metadata(&set), want);
        assert_eq!(encode_metadata(&[]), [0, 0, 0, 0]);
        assert_eq!(
            decode_string(b"\x0c\x00\x00\x00102e3ea2dccd").as_deref(),
            Some("102e3ea2dccd")
        );
        assert_eq!(decode_string(b"\x0c\x00\x00\x00short"), None);
        assert_eq!(decode_string(b"\x01"), None);
        let two = [
            ("fv-a".to_string(), "pvc-a".to_string()),
            ("fv-b".to_string(), String::new()),
        ];
        let encoded = encode_metadata(&two);
        assert_eq!(decode_metadata(&encoded).unwrap(), two);
        assert_eq!(decode_metadata(&encoded[..encoded.len() - 1]), None);
        assert_eq!(decode_metadata(&[0, 0, 0, 0]).unwrap(), []);
    }
}
