//! The FFI room of the librbd client: the functions of librados and
//! librbd (opened at run time), their C types, and the handles that own
//! what they return (a connection, an I/O context, an image that borrows
//! the context it was opened from, image options). The handles' methods
//! are the only callers of the functions, and this is the only module
//! under `src/backend/` that allows `unsafe`: the cluster logic beside it
//! (`client.rs`) forbids it.
//!
//! The functions and struct layouts are those of librbd.h and librados.h
//! (Ceph 16 and later; all are present since Ceph 15).

#![allow(unsafe_code)]

mod ctx;
mod image;

use super::super::cluster::{
    feature_bits, DiffPage, Info, Layout, Pager, Parent, Spec, TrashEntry,
};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub(super) type Rados = *mut c_void;
pub(super) type IoCtx = *mut c_void;
pub(super) type Image = *mut c_void;
pub(super) type Options = *mut c_void;

#[repr(C)]
pub(super) struct ImageSpec {
    id: *mut c_char,
    name: *mut c_char,
}

#[repr(C)]
pub(super) struct LinkedImageSpec {
    pool_id: i64,
    pool_name: *mut c_char,
    pool_namespace: *mut c_char,
    image_id: *mut c_char,
    image_name: *mut c_char,
    trash: bool,
}

#[repr(C)]
pub(super) struct SnapSpec {
    id: u64,
    namespace_type: c_int,
    name: *mut c_char,
}

#[repr(C)]
pub(super) struct TrashInfo {
    id: *mut c_char,
    name: *mut c_char,
    source: c_int,
    deletion_time: libc::time_t,
    deferment_end_time: libc::time_t,
}

#[repr(C)]
pub(super) struct SnapInfo {
    id: u64,
    size: u64,
    name: *const c_char,
}

/// librbd.h's `rbd_group_info_t`.
#[repr(C)]
pub(super) struct GroupInfo {
    name: *mut c_char,
    pool: i64,
}

#[repr(C)]
pub(super) struct GroupNamespace {
    group_pool: i64,
    group_name: *mut c_char,
    group_snap_name: *mut c_char,
}

/// librbd.h's `RBD_SNAP_NAMESPACE_TYPE_USER` and `_GROUP`.
pub(super) const SNAP_NAMESPACE_USER: c_int = 0;
pub(super) const SNAP_NAMESPACE_GROUP: c_int = 1;
/// librbd.h's `RBD_FEATURE_EXCLUSIVE_LOCK`.
pub(super) const FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;

#[repr(C)]
pub(super) struct WatcherInfo {
    addr: *mut c_char,
    id: i64,
    cookie: u64,
}

/// librbd.h's `RBD_IMAGE_OPTION_*`.
pub(super) const OPT_FEATURES: c_int = 1;
pub(super) const OPT_DATA_POOL: c_int = 10;
pub(super) const OPT_CLONE_FORMAT: c_int = 12;

macro_rules! api {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The functions of librados and librbd the backend calls.
        pub(super) struct Api {
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

pub(super) fn open(name: &str) -> std::result::Result<*mut c_void, String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: a NUL-terminated name; the handle is never closed (the
    // libraries stay for the life of the process).
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(format!("{name}: {}", dl_error()));
    }
    Ok(h)
}

pub(super) fn symbol(lib: *mut c_void, name: &str) -> std::result::Result<*mut c_void, String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: `lib` is a live handle from dlopen; the name is NUL-terminated.
    let sym = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if sym.is_null() {
        return Err(format!("{name}: {}", dl_error()));
    }
    Ok(sym)
}

pub(super) fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "not found".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

pub(super) static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();

pub(super) fn api() -> std::result::Result<&'static Api, String> {
    API.get_or_init(Api::load).as_ref().map_err(Clone::clone)
}

pub(super) fn cstr(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what} holds a NUL byte")))
}

/// Owned C string from librbd, or "" for null.
pub(super) fn owned(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: librbd hands out NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Ceph's encoding of a string: a little-endian u32 length, the bytes.
pub(super) fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s);
}

pub(super) fn decode_string(b: &[u8]) -> Option<String> {
    let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    String::from_utf8(b.get(4..4 + len)?.to_vec()).ok()
}

/// `map<string, bufferlist>` as the `rbd` class's `metadata_set` takes it:
/// a u32 count, then each key and value as a length-prefixed string.
pub(super) fn encode_metadata(set: &[(String, String)]) -> Vec<u8> {
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
pub(super) fn decode_metadata(b: &[u8]) -> Option<Vec<(String, String)>> {
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
pub(super) const MAKING: &str = "ferrovol.making";

/// A librbd listing that fills an array of `R`: called with room for a
/// few entries, again with the room it asks for (-ERANGE), then each filled
/// entry converted and the array handed back to librbd's `cleanup`.
pub(super) fn listing<R, T>(
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
pub(super) fn connection_lost(errno: i32) -> bool {
    matches!(
        errno,
        libc::ETIMEDOUT | libc::ESHUTDOWN | libc::ENOTCONN | libc::ECONNREFUSED
    )
}

/// A librbd/librados failure (`-errno`), judged by its errno like the
/// command line's exit status.
pub(super) fn failure(what: &str, ret: c_int) -> Error {
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

pub(super) fn check(what: impl FnOnce() -> String, ret: c_int) -> Result<c_int> {
    if ret < 0 {
        Err(failure(&what(), ret))
    } else {
        Ok(ret)
    }
}

/// One cluster connection (a `rados_t`), shut down when the last call
/// holding it is done.
pub(super) struct Connection {
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
pub(super) const MOUNT_TIMEOUT: &str = "20";
pub(super) const OP_TIMEOUT: &str = "30";
pub(super) const DEADLINE: Duration = Duration::from_secs(90);
/// Copies (flatten) take their time.
pub(super) const LONG: Duration = Duration::from_secs(3600);
/// Kept connections: at most this many users and keys, dropped after this
/// long unused.
pub(super) const KEPT: usize = 8;
pub(super) const IDLE: Duration = Duration::from_secs(600);
/// A connection unused this long catches up with the cluster's OSD map
/// before its next call. An idle client's map falls behind (a client is
/// only sent maps when it asks or sends an op). When it is further behind
/// than an OSD shares at once (40 epochs by default: snapshots and pg_num
/// changes each make some), librados can miss the epochs between and wait
/// for its 10 s "laggy op" check before it sends again; an op the OSD
/// dropped for a placement change (a pg_num change) waits that long. At
/// the monitors' pace (about an epoch a second) 5 s is far from 40 epochs.
pub(super) const FRESH: Duration = Duration::from_secs(5);
/// A cluster call that takes longer is logged (a snapshot's monitor commit
/// takes about a second).
pub(super) const SLOW: Duration = Duration::from_secs(5);

impl Connection {
    /// The function table its handles call.
    pub(super) fn api(&self) -> &'static Api {
        self.api
    }

    pub(super) fn open(
        api: &'static Api,
        monitors: &str,
        user: &str,
        key: &str,
    ) -> Result<Connection> {
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
    pub(super) fn fresh(&self) -> Result<()> {
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
    pub(super) fn ioctx(&self, place: &Spec) -> Result<Ctx<'_>> {
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
    pub(super) fn mon_command(&self, json: &str) -> Result<String> {
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
pub(super) struct Ctx<'a> {
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
pub(super) struct Img<'c, 's> {
    ctx: &'c Ctx<'c>,
    image: Image,
    spec: &'s Spec,
}

impl Drop for Img<'_, '_> {
    fn drop(&mut self) {
        // SAFETY: opened by rbd_open*, closed once, before its context
        // (the image borrows it).
        unsafe { (self.api().rbd_close)(self.image) };
    }
}

/// Image options, destroyed when dropped.
pub(super) struct Opts {
    api: &'static Api,
    opts: Options,
}

// SAFETY: the options are plain data owned by this value, used by one
// thread at a time (built here, read by the call on the blocking pool).
unsafe impl Send for Opts {}

impl Drop for Opts {
    fn drop(&mut self) {
        // SAFETY: created by rbd_image_options_create, destroyed once.
        unsafe { (self.api().rbd_image_options_destroy)(self.opts) }
    }
}

impl Opts {
    fn api(&self) -> &'static Api {
        self.api
    }

    pub(super) fn ptr(&self) -> Options {
        self.opts
    }
    pub(super) fn new(api: &'static Api) -> Opts {
        let mut opts: Options = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        unsafe { (api.rbd_image_options_create)(&mut opts) };
        Opts { api, opts }
    }
    pub(super) fn layout(self, layout: Layout<'_>) -> Result<Opts> {
        let bits = feature_bits(layout.features)?;
        // SAFETY: live options; option ids from librbd.h.
        check(|| "image option features".into(), unsafe {
            (self.api().rbd_image_options_set_uint64)(self.opts, OPT_FEATURES, bits)
        })?;
        if !layout.data_pool.is_empty() {
            let pool = cstr("data pool", layout.data_pool)?;
            // SAFETY: as above; the string is copied.
            check(|| "image option data_pool".into(), unsafe {
                (self.api().rbd_image_options_set_string)(self.opts, OPT_DATA_POOL, pool.as_ptr())
            })?;
        }
        Ok(self)
    }
}

impl Opts {
    /// Clones of format 2 (no protected snapshot needed).
    pub(super) fn clone_format_2(self) -> Result<Opts> {
        // SAFETY: live options; option id from librbd.h.
        check(|| "image option clone_format".into(), unsafe {
            (self.api().rbd_image_options_set_uint64)(self.opts, OPT_CLONE_FORMAT, 2)
        })?;
        Ok(self)
    }
}

/// Milliseconds since the first time asked: a clock for connections'
/// idleness.
pub(super) fn now_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
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
