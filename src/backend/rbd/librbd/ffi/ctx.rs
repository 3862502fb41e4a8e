//! An I/O context's calls: images opened, looked up and made, their
//! metadata, the trash, the pool's namespaces and groups.

use super::*;

impl Ctx<'_> {
    pub(in crate::backend::rbd::librbd) fn api(&self) -> &'static Api {
        self.conn.api
    }

    pub(in crate::backend::rbd::librbd) fn open<'c, 's>(
        &'c self,
        spec: &'s Spec,
        write: bool,
    ) -> Result<Img<'c, 's>> {
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
            ctx: self,
            image,
            spec,
        })
    }

    /// The image read-only at its snapshot `snap`.
    pub(in crate::backend::rbd::librbd) fn open_at<'c, 's>(
        &'c self,
        spec: &'s Spec,
        snap: &str,
    ) -> Result<Img<'c, 's>> {
        let name = cstr("image", &spec.image)?;
        let at = cstr("snapshot", snap)?;
        let mut image: Image = std::ptr::null_mut();
        // SAFETY: a live ioctx, NUL-terminated names.
        check(|| format!("open image {}@{snap}", spec.arg()), unsafe {
            (self.api().rbd_open_read_only)(self.io, name.as_ptr(), &mut image, at.as_ptr())
        })?;
        Ok(Img {
            ctx: self,
            image,
            spec,
        })
    }

    /// Whether the image exists: its id object (`rbd_id.<name>`, where
    /// format 2 images have kept their id since 2012) read by one OSD op,
    /// without the cost of opening an image.
    pub(in crate::backend::rbd::librbd) fn exists(&self, spec: &Spec) -> Result<bool> {
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
    pub(in crate::backend::rbd::librbd) fn image_id(&self, spec: &Spec) -> Result<String> {
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
    pub(in crate::backend::rbd::librbd) fn set_meta_unopened(
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
    pub(in crate::backend::rbd::librbd) fn class_call(
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
    pub(in crate::backend::rbd::librbd) fn meta_of(
        &self,
        object: &str,
    ) -> Result<BTreeMap<String, String>> {
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
    pub(in crate::backend::rbd::librbd) fn making(
        &self,
        method: &str,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<usize> {
        self.class_call(MAKING, method, input, out)
    }

    /// Removes `image` from the place's record of images being made.
    pub(in crate::backend::rbd::librbd) fn unintend(&self, image: &str) -> Result<()> {
        let mut key = Vec::new();
        encode_string(&mut key, image.as_bytes());
        match self.making("metadata_remove", &key, &mut []) {
            Err(e) if e.os_error == Some(libc::ENOENT) => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// Every image the place's record says is being made, with its CSI
    /// name (none when there is no record).
    pub(in crate::backend::rbd::librbd) fn being_made(&self) -> Result<BTreeMap<String, String>> {
        self.meta_of(MAKING)
    }

    pub(in crate::backend::rbd::librbd) fn list(&self) -> Result<Vec<(String, String)>> {
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

/// Calls of an I/O context that change the pool's directory, trash and
/// groups.
impl Ctx<'_> {
    /// The pool's namespaces (none where the pool has no directory of
    /// them yet).
    pub(in crate::backend::rbd::librbd) fn namespaces(&self) -> Result<Vec<String>> {
        let mut cap = 1024usize;
        loop {
            let mut buf = vec![0u8; cap];
            let mut len = cap;
            // SAFETY: a live ioctx, a buffer of `len` bytes.
            let ret = unsafe {
                (self.api().rbd_namespace_list)(self.io, buf.as_mut_ptr() as *mut c_char, &mut len)
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
    }

    /// The trash's entries.
    pub(in crate::backend::rbd::librbd) fn trash(&self) -> Result<Vec<TrashEntry>> {
        let api = self.api();
        listing(
            || "list the trash".into(),
            16,
            // SAFETY: a live ioctx; room for `n` entries.
            |rows, n| unsafe { (api.rbd_trash_list)(self.io, rows, n) },
            api.rbd_trash_list_cleanup,
            |t: &TrashInfo| TrashEntry {
                id: owned(t.id),
                name: owned(t.name),
            },
        )
    }

    /// Moves the image to the trash (out of the directory, its data kept).
    pub(in crate::backend::rbd::librbd) fn trash_move(&self, spec: &Spec) -> Result<()> {
        let name = cstr("image", &spec.image)?;
        // SAFETY: a live ioctx, NUL-terminated name.
        check(|| format!("move {} to the trash", spec.arg()), unsafe {
            (self.api().rbd_trash_move)(self.io, name.as_ptr(), 0)
        })
        .map(|_| ())
    }

    /// Removes a trash entry and its data.
    pub(in crate::backend::rbd::librbd) fn trash_remove(&self, id: &str) -> Result<()> {
        let i = cstr("trash id", id)?;
        // SAFETY: a live ioctx, NUL-terminated id.
        check(|| format!("remove {id} from the trash"), unsafe {
            (self.api().rbd_trash_remove)(self.io, i.as_ptr(), false)
        })
        .map(|_| ())
    }

    /// Makes an image of `size` bytes.
    pub(in crate::backend::rbd::librbd) fn create(
        &self,
        spec: &Spec,
        size: u64,
        opts: &Opts,
    ) -> Result<()> {
        let name = cstr("image", &spec.image)?;
        // SAFETY: a live ioctx and options, NUL-terminated name.
        check(|| format!("create {}", spec.arg()), unsafe {
            (self.api().rbd_create4)(self.io, name.as_ptr(), size, opts.ptr())
        })
        .map(|_| ())
    }

    /// Clones this context's image `parent` at its snapshot `snap` as
    /// `to`, in `to_ctx`.
    pub(in crate::backend::rbd::librbd) fn clone_to(
        &self,
        parent: &Spec,
        snap: &str,
        to_ctx: &Ctx<'_>,
        to: &Spec,
        opts: &Opts,
    ) -> Result<()> {
        let (pn, sn, cn) = (
            cstr("image", &parent.image)?,
            cstr("snapshot", snap)?,
            cstr("image", &to.image)?,
        );
        // SAFETY: live ioctxs and options, NUL-terminated names.
        check(
            || format!("clone {}@{snap} to {}", parent.arg(), to.arg()),
            unsafe {
                (self.api().rbd_clone3)(
                    self.io,
                    pn.as_ptr(),
                    sn.as_ptr(),
                    to_ctx.io,
                    cn.as_ptr(),
                    opts.ptr(),
                )
            },
        )
        .map(|_| ())
    }

    /// Removes an image and its data.
    pub(in crate::backend::rbd::librbd) fn remove(&self, spec: &Spec) -> Result<()> {
        let name = cstr("image", &spec.image)?;
        // SAFETY: a live ioctx, NUL-terminated name.
        check(|| format!("remove {}", spec.arg()), unsafe {
            (self.api().rbd_remove)(self.io, name.as_ptr())
        })
        .map(|_| ())
    }

    /// Renames the image `from` to `to` (in the same pool and namespace).
    pub(in crate::backend::rbd::librbd) fn rename(&self, from: &Spec, to: &str) -> Result<()> {
        let (a, b) = (cstr("image", &from.image)?, cstr("image", to)?);
        // SAFETY: a live ioctx, NUL-terminated names.
        check(|| format!("rename {} to {to}", from.arg()), unsafe {
            (self.api().rbd_rename)(self.io, a.as_ptr(), b.as_ptr())
        })
        .map(|_| ())
    }

    /// Makes the rbd group `name`; `what` names it in errors (EEXIST
    /// when it exists).
    pub(in crate::backend::rbd::librbd) fn group_create(
        &self,
        name: &str,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let g = cstr("group", name)?;
        // SAFETY: a live ioctx, a NUL-terminated name.
        check(what, unsafe {
            (self.api().rbd_group_create)(self.io, g.as_ptr())
        })
        .map(|_| ())
    }

    /// Removes the rbd group `name`, its snapshots and its members' place
    /// in it.
    pub(in crate::backend::rbd::librbd) fn group_remove(
        &self,
        name: &str,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let g = cstr("group", name)?;
        // SAFETY: a live ioctx, a NUL-terminated name.
        check(what, unsafe {
            (self.api().rbd_group_remove)(self.io, g.as_ptr())
        })
        .map(|_| ())
    }

    /// Adds the image `member` (of `member_ctx`) to the group `name`.
    pub(in crate::backend::rbd::librbd) fn group_add(
        &self,
        name: &str,
        member_ctx: &Ctx<'_>,
        member: &Spec,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let (g, m) = (cstr("group", name)?, cstr("image", &member.image)?);
        // SAFETY: live ioctxs, NUL-terminated names.
        check(what, unsafe {
            (self.api().rbd_group_image_add)(self.io, g.as_ptr(), member_ctx.io, m.as_ptr())
        })
        .map(|_| ())
    }

    /// Snapshots the group `name`: every member at one instant.
    pub(in crate::backend::rbd::librbd) fn group_snap_create(
        &self,
        name: &str,
        snap: &str,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let (g, s) = (cstr("group", name)?, cstr("snapshot", snap)?);
        // SAFETY: a live ioctx, NUL-terminated names.
        check(what, unsafe {
            (self.api().rbd_group_snap_create2)(self.io, g.as_ptr(), s.as_ptr(), 0)
        })
        .map(|_| ())
    }
}
