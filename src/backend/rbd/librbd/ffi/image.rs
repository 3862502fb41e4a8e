//! An open image's calls: what it is, its snapshots and their blocks, its
//! size, locks and copies.

use super::*;

impl Img<'_, '_> {
    pub(super) fn api(&self) -> &'static Api {
        self.ctx.api()
    }

    pub(in crate::backend::rbd::librbd) fn what(&self, op: &str) -> String {
        format!("{op} {}", self.spec.arg())
    }

    pub(in crate::backend::rbd::librbd) fn size(&self) -> Result<u64> {
        let mut size = 0u64;
        // SAFETY: an open image, valid out pointer.
        check(|| self.what("size of"), unsafe {
            (self.api().rbd_get_size)(self.image, &mut size)
        })?;
        Ok(size)
    }

    pub(in crate::backend::rbd::librbd) fn parent(&self) -> Result<Option<Parent>> {
        // SAFETY: zeroed structs are valid "empty" ones for librbd to fill.
        let mut image: LinkedImageSpec = unsafe { std::mem::zeroed() };
        let mut snap: SnapSpec = unsafe { std::mem::zeroed() };
        // SAFETY: an open image and valid out pointers.
        let ret = unsafe { (self.api().rbd_get_parent)(self.image, &mut image, &mut snap) };
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
            (self.api().rbd_linked_image_spec_cleanup)(&mut image);
            (self.api().rbd_snap_spec_cleanup)(&mut snap);
        }
        Ok(Some(parent))
    }

    pub(in crate::backend::rbd::librbd) fn info(&self) -> Result<Info> {
        Ok(Info {
            size: self.size()?,
            parent: self.parent()?,
        })
    }

    pub(in crate::backend::rbd::librbd) fn meta(&self) -> Result<BTreeMap<String, String>> {
        let (mut keys_cap, mut vals_cap) = (4096usize, 4096usize);
        let start = cstr("start", "")?;
        loop {
            let mut keys = vec![0u8; keys_cap];
            let mut vals = vec![0u8; vals_cap];
            let (mut kl, mut vl) = (keys_cap, vals_cap);
            // SAFETY: buffers of the lengths given; librbd writes within.
            let ret = unsafe {
                (self.api().rbd_metadata_list)(
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

    pub(in crate::backend::rbd::librbd) fn set_meta(&self, key: &str, value: &str) -> Result<()> {
        let k = cstr("metadata key", key)?;
        let v = cstr("metadata value", value)?;
        // SAFETY: an image open for writing, NUL-terminated strings.
        check(|| self.what("set metadata of"), unsafe {
            (self.api().rbd_metadata_set)(self.image, k.as_ptr(), v.as_ptr())
        })
        .map(|_| ())
    }

    pub(in crate::backend::rbd::librbd) fn remove_meta(&self, key: &str) -> Result<()> {
        let k = cstr("metadata key", key)?;
        // SAFETY: as above.
        match check(|| self.what("remove metadata of"), unsafe {
            (self.api().rbd_metadata_remove)(self.image, k.as_ptr())
        }) {
            Ok(_) => Ok(()),
            Err(e) if e.os_error == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub(in crate::backend::rbd::librbd) fn features(&self) -> Result<u64> {
        let mut bits = 0u64;
        // SAFETY: an open image, valid out pointer.
        check(|| self.what("features of"), unsafe {
            (self.api().rbd_get_features)(self.image, &mut bits)
        })?;
        Ok(bits)
    }

    /// Every snapshot of the image (all namespaces): id and name.
    pub(in crate::backend::rbd::librbd) fn snap_list(&self) -> Result<Vec<(u64, String)>> {
        let mut cap: c_int = 16;
        loop {
            let mut rows: Vec<SnapInfo> = Vec::with_capacity(cap as usize);
            let mut n = cap;
            // SAFETY: an open image; room for `n` entries (the list ends
            // with an entry of its own).
            let ret = unsafe { (self.api().rbd_snap_list)(self.image, rows.as_mut_ptr(), &mut n) };
            if ret == -libc::ERANGE && n > cap {
                cap = n;
                continue;
            }
            let count = check(|| self.what("snapshots of"), ret)? as usize;
            // SAFETY: librbd filled `count` entries and the end marker.
            unsafe { rows.set_len(count) };
            let out = rows.iter().map(|r| (r.id, owned(r.name))).collect();
            // SAFETY: the list librbd filled, handed back once.
            unsafe { (self.api().rbd_snap_list_end)(rows.as_mut_ptr()) };
            return Ok(out);
        }
    }

    pub(in crate::backend::rbd::librbd) fn snap_namespace(&self, id: u64) -> Result<c_int> {
        let mut kind: c_int = 0;
        // SAFETY: an open image, a snapshot id it listed, out pointer.
        check(|| self.what("snapshot namespace of"), unsafe {
            (self.api().rbd_snap_get_namespace_type)(self.image, id, &mut kind)
        })?;
        Ok(kind)
    }

    /// The group of ours (`fvg-`, in the image's own pool) that holds it:
    /// only a group snapshot cut short leaves one.
    pub(in crate::backend::rbd::librbd) fn leftover_group(
        &self,
        ctx: &Ctx<'_>,
    ) -> Result<Option<String>> {
        let api = self.api();
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
    pub(in crate::backend::rbd::librbd) fn user_snaps(&self) -> Result<Vec<String>> {
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
    pub(in crate::backend::rbd::librbd) fn group_snap_id(&self, group: &str) -> Result<u64> {
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
                (self.api().rbd_snap_get_group_namespace)(self.image, id, &mut ns, size)
            })?;
            let name = owned(ns.group_name);
            // SAFETY: filled above, freed once.
            unsafe { (self.api().rbd_snap_group_namespace_cleanup)(&mut ns, size) };
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
    pub(in crate::backend::rbd::librbd) fn diff(
        &self,
        from: Option<&str>,
        start: u64,
        max: usize,
    ) -> Result<DiffPage> {
        let size = self.size()?;
        let mut pager = Pager::new(start, max);
        if start < size {
            let from = from.map(|f| cstr("snapshot", f)).transpose()?;
            let from_ptr = from.as_ref().map_or(std::ptr::null(), |f| f.as_ptr());
            // SAFETY: an open image; `pager` outlives the walk, which
            // calls back on this thread only; exact extents, parent's too.
            let ret = unsafe {
                (self.api().rbd_diff_iterate2)(
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

    pub(in crate::backend::rbd::librbd) fn watchers(&self) -> Result<Vec<String>> {
        listing(
            || self.what("watchers of"),
            8,
            // SAFETY: an open image; room for `n` entries.
            |rows, n| unsafe { (self.api().rbd_watchers_list)(self.image, rows, n) },
            self.api().rbd_watchers_list_cleanup,
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

/// Calls of an open image that change it.
impl Img<'_, '_> {
    /// The image this handle has open.
    pub(in crate::backend::rbd::librbd) fn spec(&self) -> &Spec {
        self.spec
    }

    /// Whether writers hand over a lock while a snapshot is cut.
    pub(in crate::backend::rbd::librbd) fn has_exclusive_lock(&self) -> Result<bool> {
        Ok(self.features()? & FEATURE_EXCLUSIVE_LOCK != 0)
    }

    pub(in crate::backend::rbd::librbd) fn resize(&self, size: u64) -> Result<()> {
        // SAFETY: an image open for writing.
        check(|| self.what("resize"), unsafe {
            (self.api().rbd_resize)(self.image, size)
        })
        .map(|_| ())
    }

    pub(in crate::backend::rbd::librbd) fn flatten(&self) -> Result<()> {
        // SAFETY: an image open for writing.
        check(|| self.what("flatten"), unsafe {
            (self.api().rbd_flatten)(self.image)
        })
        .map(|_| ())
    }

    pub(in crate::backend::rbd::librbd) fn snap_create(&self, snap: &str) -> Result<()> {
        self.name_op("snapshot", self.api().rbd_snap_create, snap)
    }

    pub(in crate::backend::rbd::librbd) fn snap_remove(&self, snap: &str) -> Result<()> {
        self.name_op("remove snapshot", self.api().rbd_snap_remove, snap)
    }

    /// Takes the image's exclusive lock from its writers (EINVAL: the
    /// image has no exclusive-lock feature).
    pub(in crate::backend::rbd::librbd) fn lock(&self) -> Result<()> {
        // SAFETY: an image open for writing; 0 is RBD_LOCK_MODE_EXCLUSIVE.
        let ret = unsafe { (self.api().rbd_lock_acquire)(self.image, 0) };
        check(|| self.what("take the exclusive lock of"), ret).map(|_| ())
    }

    /// Gives back a lock [`Img::lock`] took.
    pub(in crate::backend::rbd::librbd) fn unlock(&self) {
        // SAFETY: a lock this handle took.
        unsafe { (self.api().rbd_lock_release)(self.image) };
    }

    /// Reads the image at the snapshot of this id from now on.
    pub(in crate::backend::rbd::librbd) fn at_snap_id(&self, id: u64) -> Result<()> {
        // SAFETY: an open image.
        check(|| self.what("open the group's snapshot of"), unsafe {
            (self.api().rbd_snap_set_by_id)(self.image, id)
        })
        .map(|_| ())
    }

    /// Copies the image as it reads now (its snapshot, after
    /// [`Img::at_snap_id`]) to a new image `to` in `to_ctx`.
    pub(in crate::backend::rbd::librbd) fn copy_to(
        &self,
        to_ctx: &Ctx<'_>,
        to: &Spec,
        opts: &Opts,
    ) -> Result<()> {
        let name = cstr("image", &to.image)?;
        // SAFETY: an open image, a live ioctx and options, a NUL-terminated
        // name.
        check(
            || format!("copy {} as cut to {}", self.spec.arg(), to.arg()),
            unsafe { (self.api().rbd_copy3)(self.image, to_ctx.io, name.as_ptr(), opts.ptr()) },
        )
        .map(|_| ())
    }
}
