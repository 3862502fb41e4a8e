//! The rules every backend applies the same way: the size a new volume
//! gets, whether an existing volume answers a retried CreateVolume, what an
//! expansion asks for, and whether a content source is the backend's own.

use super::{ContentSource, CreateVolume};
use crate::error::{Error, Result};

/// The least a new volume holds for the filesystems its capabilities name
/// to be made on it at stage: mkfs.xfs refuses a filesystem under 300 MiB
/// (xfsprogs 5.19 and later), mkfs.btrfs one under 109 MiB; ext4 has no
/// floor that matters. An encrypted volume's filesystem is 2 MiB smaller
/// than the volume (the LUKS2 header). 0: no floor.
pub fn filesystem_floor(capabilities: &[super::VolumeCapability], encrypted: bool) -> u64 {
    const MIB: u64 = 1 << 20;
    let floor = capabilities
        .iter()
        .map(|c| match &c.access {
            super::AccessType::Mount { fs_type, .. } => match fs_type.as_str() {
                "xfs" => 300 * MIB,
                "btrfs" => 109 * MIB,
                _ => 0,
            },
            super::AccessType::Block => 0,
        })
        .max()
        .unwrap_or(0);
    match floor {
        0 => 0,
        f if encrypted => f + 2 * MIB,
        f => f,
    }
}

/// `bytes` rounded up to a whole number of `step`s.
pub fn round_up(bytes: u64, step: u64) -> u64 {
    bytes.div_ceil(step).saturating_mul(step)
}

/// How a backend sizes volumes: its allocation unit (1 MiB for an image,
/// the extent size for an LV), the size of a volume whose request names
/// none, and the largest it makes (if any).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeRules {
    pub step: u64,
    pub default: u64,
    pub max: Option<u64>,
}

impl SizeRules {
    /// The size of a new volume: at least the request's required bytes and
    /// the source's size, the default when the request names neither, in
    /// whole steps; the largest whole number of steps under the limit when
    /// rounding up would pass it. OUT_OF_RANGE when nothing fits.
    pub fn new_volume(&self, required: u64, limit: u64, source_size: u64) -> Result<u64> {
        let floor = required.max(source_size);
        let wanted = if floor > 0 { floor } else { self.default };
        let mut size = round_up(wanted, self.step);
        if limit > 0 && size > limit {
            size = limit / self.step * self.step;
        }
        if size == 0 || size < floor || (limit > 0 && size > limit) {
            return Err(Error::out_of_range(format!(
                "no size in {}-byte steps fits required {required} and limit {limit} bytes (source {source_size})",
                self.step
            )));
        }
        if let Some(max) = self.max.filter(|m| size > *m) {
            return Err(Error::out_of_range(format!(
                "{size} bytes is more than the largest volume here, {max}"
            )));
        }
        Ok(size)
    }

    /// The size an expansion asks for: `None` when the volume already has
    /// at least `required` bytes (no shrink, ever), else the new size in
    /// whole steps. OUT_OF_RANGE past the limit or the maximum.
    pub fn expansion(&self, current: u64, required: u64, limit: u64) -> Result<Option<u64>> {
        let wanted = round_up(required, self.step);
        if limit > 0 && wanted > limit {
            return Err(Error::out_of_range(format!(
                "{required} bytes rounded to {}-byte steps is {wanted}, above the limit {limit}",
                self.step
            )));
        }
        if wanted <= current {
            return Ok(None);
        }
        if let Some(max) = self.max.filter(|m| wanted > *m) {
            return Err(Error::out_of_range(format!(
                "{wanted} bytes is more than the largest volume here, {max}"
            )));
        }
        Ok(Some(wanted))
    }
}

/// Whether an existing volume of the same name answers a retried
/// CreateVolume: its size within the request's range, the same source.
/// ALREADY_EXISTS otherwise, as the spec asks.
pub fn check_existing(req: &CreateVolume, size: u64, source: Option<&ContentSource>) -> Result<()> {
    let fits = size >= req.required_bytes && (req.limit_bytes == 0 || size <= req.limit_bytes);
    if !fits || source != req.source.as_ref() {
        return Err(Error::already_exists(format!(
            "volume {:?} exists with {size} bytes and source {source:?}, incompatible with this request",
            req.name
        )));
    }
    Ok(())
}

/// The locator of a content source that belongs to `backend`; NOT_FOUND
/// (a source that does not exist, as far as this backend knows) otherwise.
pub fn own_source<'a>(backend: &str, source: &'a ContentSource) -> Result<&'a str> {
    let (owner, locator, kind, shown) = match source {
        ContentSource::Snapshot(id) => (id.backend(), id.locator(), "snapshot", id.to_string()),
        ContentSource::Volume(id) => (id.backend(), id.locator(), "volume", id.to_string()),
    };
    if owner != backend {
        return Err(Error::not_found(format!(
            "source {kind} {shown} does not exist in backend {backend}"
        )));
    }
    Ok(locator)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;
    use crate::plugin::{Secrets, SnapshotId, VolumeId};

    const MIB: u64 = 1 << 20;
    const EXTENT: u64 = 4 * MIB;

    fn rules(step: u64) -> SizeRules {
        SizeRules {
            step,
            default: 1 << 30,
            max: Some(1 << 40),
        }
    }

    #[test]
    fn new_volumes_round_up_to_whole_steps() {
        let r = rules(EXTENT);
        assert_eq!(r.new_volume(10 * MIB + 1, 0, 0).unwrap(), 12 * MIB);
        assert_eq!(r.new_volume(12 * MIB, 0, 0).unwrap(), 12 * MIB);
        assert_eq!(r.new_volume(1, 0, 0).unwrap(), EXTENT);
        // No size named: the default; a source sets the floor.
        assert_eq!(r.new_volume(0, 0, 0).unwrap(), 1 << 30);
        assert_eq!(r.new_volume(0, 0, 9 * MIB).unwrap(), 12 * MIB);
        assert_eq!(r.new_volume(MIB, 0, 9 * MIB).unwrap(), 12 * MIB);
        // Within a limit that is not a whole step.
        assert_eq!(r.new_volume(5 * MIB, 10 * MIB, 0).unwrap(), 8 * MIB);
        // 1 MiB steps (image files) keep exact MiB sizes.
        assert_eq!(rules(MIB).new_volume(5 * MIB + 1, 0, 0).unwrap(), 6 * MIB);
    }

    #[test]
    fn nothing_fits_is_out_of_range() {
        let r = rules(EXTENT);
        for (req, lim, src) in [
            (9 * MIB, 11 * MIB, 0), // 12 > 11 and 8 < 9
            (0, 3 * MIB, 0),        // not one extent under the limit
            (0, 8 * MIB, 9 * MIB),  // the source does not fit
            (2 << 40, 0, 0),        // above the maximum
        ] {
            assert_eq!(
                r.new_volume(req, lim, src).unwrap_err().kind,
                Kind::OutOfRange,
                "{req} {lim} {src}"
            );
        }
        // The default is cut down to the limit, in whole steps.
        assert_eq!(r.new_volume(0, 10 * MIB, 0).unwrap(), 8 * MIB);
    }

    #[test]
    fn expansion_grows_in_steps_and_never_shrinks() {
        let r = rules(EXTENT);
        assert_eq!(r.expansion(8 * MIB, 9 * MIB, 0).unwrap(), Some(12 * MIB));
        assert_eq!(r.expansion(8 * MIB, 4 * MIB, 0).unwrap(), None);
        assert_eq!(r.expansion(8 * MIB, 8 * MIB, 0).unwrap(), None);
        assert_eq!(
            r.expansion(8 * MIB, 9 * MIB, 10 * MIB).unwrap_err().kind,
            Kind::OutOfRange
        );
        assert_eq!(
            r.expansion(8 * MIB, 2 << 40, 0).unwrap_err().kind,
            Kind::OutOfRange
        );
    }

    fn req(required: u64, limit: u64, source: Option<ContentSource>) -> CreateVolume {
        CreateVolume {
            name: "pvc-1".into(),
            required_bytes: required,
            limit_bytes: limit,
            capabilities: vec![],
            parameters: Default::default(),
            metadata: Default::default(),
            source,
            secrets: Secrets::default(),
        }
    }

    #[test]
    fn an_existing_volume_answers_only_a_compatible_retry() {
        let snap = ContentSource::Snapshot(SnapshotId::parse("file:s1").unwrap());
        assert!(check_existing(&req(10, 0, None), 12, None).is_ok());
        assert!(check_existing(&req(10, 12, None), 12, None).is_ok());
        for (r, size, source) in [
            (req(13, 0, None), 12, None),
            (req(1, 11, None), 12, None),
            (req(1, 0, None), 12, Some(&snap)),
            (req(1, 0, Some(snap.clone())), 12, None),
        ] {
            assert_eq!(
                check_existing(&r, size, source).unwrap_err().kind,
                Kind::AlreadyExists
            );
        }
    }

    #[test]
    fn sources_of_other_backends_do_not_exist_here() {
        let v = ContentSource::Volume(VolumeId::parse("lvm:fast.fv-a").unwrap());
        assert_eq!(own_source("lvm", &v).unwrap(), "fast.fv-a");
        assert_eq!(own_source("file", &v).unwrap_err().kind, Kind::NotFound);
    }
}
