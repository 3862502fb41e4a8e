//! The crate's error type, and the one place where errors become gRPC codes.

use std::fmt;

/// What went wrong, classified by how the caller should react. Each kind maps
/// to exactly one gRPC code in [`Error::to_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    OutOfRange,
    ResourceExhausted,
    Aborted,
    Unimplemented,
    Unavailable,
    Internal,
}

/// A classified error with a human-readable message. Messages never contain
/// secrets: the exec seam redacts them before they reach an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub kind: Kind,
    pub message: String,
    /// The OS error number behind it, when a system call failed: callers
    /// that must tell one errno from another (ESTALE) ask this, never the
    /// message.
    pub os_error: Option<i32>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            os_error: None,
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Kind::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Kind::NotFound, message)
    }
    pub fn already_exists(message: impl Into<String>) -> Self {
        Self::new(Kind::AlreadyExists, message)
    }
    pub fn precondition(message: impl Into<String>) -> Self {
        Self::new(Kind::FailedPrecondition, message)
    }
    pub fn out_of_range(message: impl Into<String>) -> Self {
        Self::new(Kind::OutOfRange, message)
    }
    pub fn exhausted(message: impl Into<String>) -> Self {
        Self::new(Kind::ResourceExhausted, message)
    }
    pub fn aborted(message: impl Into<String>) -> Self {
        Self::new(Kind::Aborted, message)
    }
    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(Kind::Unimplemented, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Kind::Unavailable, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Kind::Internal, message)
    }

    /// The rule for a volume that does not exist, wherever it is found
    /// missing: NOT_FOUND (the CSI spec's answer for every call that names
    /// one), saying which.
    pub fn no_volume(id: impl fmt::Display) -> Self {
        Self::not_found(format!("volume {id} does not exist"))
    }

    /// The same rule for a snapshot.
    pub fn no_snapshot(id: impl fmt::Display) -> Self {
        Self::not_found(format!("snapshot {id} does not exist"))
    }

    /// The rule for a volume (or snapshot) something still uses, found
    /// where it would be deleted, grown or unstaged: FAILED_PRECONDITION
    /// (the spec's answer for a volume in use), saying who uses it and what
    /// frees it. `what` names it: "volume v".
    pub fn in_use(what: impl fmt::Display, by: impl fmt::Display, then: &str) -> Self {
        Self::precondition(format!("{what} is in use ({by}); {then}"))
    }

    /// The rule for something the driver did not make, found where it
    /// would act (a mount, an image, a device's contents): it is left as it
    /// is, FAILED_PRECONDITION, naming it and what was not done.
    pub fn not_ours(what: impl fmt::Display, left: &str) -> Self {
        Self::precondition(format!("{what} was not made by ferrovol; {left}"))
    }

    /// The rule for a StorageClass parameter a backend does not take:
    /// INVALID_ARGUMENT, listing the ones it does.
    pub fn unknown_parameter(backend: &str, key: &str, known: &[&str]) -> Self {
        let takes = match known {
            [] => "it takes none".to_string(),
            k => format!("it takes {}", k.join(", ")),
        };
        Self::invalid(format!(
            "backend {backend} takes no parameter {key:?} ({takes})"
        ))
    }

    /// The rule for a size no volume here can have, whatever is freed:
    /// OUT_OF_RANGE (the spec's unsupported capacity), with what bounds it.
    pub fn too_big(bytes: u64, whole: impl fmt::Display, holds: u64) -> Self {
        Self::out_of_range(format!(
            "{bytes} bytes is more than {whole} holds ({holds} bytes)"
        ))
    }

    /// A required size over the caller's own limit: the same rule.
    pub fn over_limit(required: u64, limit: u64) -> Self {
        Self::out_of_range(format!(
            "required_bytes {required} exceeds limit_bytes {limit}"
        ))
    }

    /// The rule for room that is short now but may be freed:
    /// RESOURCE_EXHAUSTED, with what is free and what was needed.
    pub fn no_room(whole: impl fmt::Display, free: u64, needed: impl fmt::Display) -> Self {
        Self::exhausted(format!("{whole} has {free} bytes free, {needed} needed"))
    }

    /// An I/O error with what was being done when it happened.
    pub fn io(context: impl fmt::Display, err: std::io::Error) -> Self {
        let kind = match err.kind() {
            std::io::ErrorKind::NotFound => Kind::NotFound,
            std::io::ErrorKind::StorageFull => Kind::ResourceExhausted,
            _ => Kind::Internal,
        };
        Self {
            os_error: err.raw_os_error(),
            ..Self::new(kind, format!("{context}: {err}"))
        }
    }

    /// Prefixes the message with context, keeping the kind.
    pub fn context(self, context: impl fmt::Display) -> Self {
        Self {
            kind: self.kind,
            message: format!("{context}: {}", self.message),
            os_error: self.os_error,
        }
    }

    /// The gRPC status for this error: the only place codes are chosen.
    pub fn to_status(&self) -> tonic::Status {
        use tonic::Code;
        let code = match self.kind {
            Kind::InvalidArgument => Code::InvalidArgument,
            Kind::NotFound => Code::NotFound,
            Kind::AlreadyExists => Code::AlreadyExists,
            Kind::FailedPrecondition => Code::FailedPrecondition,
            Kind::OutOfRange => Code::OutOfRange,
            Kind::ResourceExhausted => Code::ResourceExhausted,
            Kind::Aborted => Code::Aborted,
            Kind::Unimplemented => Code::Unimplemented,
            Kind::Unavailable => Code::Unavailable,
            Kind::Internal => Code::Internal,
        };
        tonic::Status::new(code, self.message.clone())
    }
}

/// Room for `needed` bytes in `whole` (a pool, a volume group) that
/// `holds` in all with `free` left now: more than it holds is
/// [`Error::too_big`], final (the CO lets the user ask for less); more
/// than is free may be freed later, [`Error::no_room`].
pub fn room(needed: u64, whole: impl fmt::Display, holds: u64, free: u64) -> Result<()> {
    if needed > holds {
        return Err(Error::too_big(needed, whole, holds));
    }
    if needed > free {
        return Err(Error::no_room(whole, free, needed));
    }
    Ok(())
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

impl std::error::Error for Error {}

impl From<Error> for tonic::Status {
    fn from(err: Error) -> Self {
        err.to_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_map_to_grpc_codes() {
        let cases = [
            (Error::invalid("x"), tonic::Code::InvalidArgument),
            (Error::not_found("x"), tonic::Code::NotFound),
            (Error::already_exists("x"), tonic::Code::AlreadyExists),
            (Error::precondition("x"), tonic::Code::FailedPrecondition),
            (Error::out_of_range("x"), tonic::Code::OutOfRange),
            (Error::exhausted("x"), tonic::Code::ResourceExhausted),
            (Error::aborted("x"), tonic::Code::Aborted),
            (Error::unimplemented("x"), tonic::Code::Unimplemented),
            (Error::internal("x"), tonic::Code::Internal),
        ];
        for (err, code) in cases {
            assert_eq!(err.to_status().code(), code, "{err}");
        }
    }

    #[test]
    fn each_rule_has_its_code() {
        use tonic::Code;
        let cases = [
            (Error::no_volume("v"), Code::NotFound),
            (Error::no_snapshot("s"), Code::NotFound),
            (
                Error::in_use("volume v", "mapped by n1", "unmap it"),
                Code::FailedPrecondition,
            ),
            (
                Error::not_ours("image p/x", "not deleting it"),
                Code::FailedPrecondition,
            ),
            (
                Error::unknown_parameter("b", "k", &[]),
                Code::InvalidArgument,
            ),
            (Error::too_big(10, "pool /p", 5), Code::OutOfRange),
            (Error::over_limit(10, 5), Code::OutOfRange),
            (Error::no_room("pool /p", 1, 2), Code::ResourceExhausted),
        ];
        for (err, code) in cases {
            assert_eq!(err.to_status().code(), code, "{err}");
        }
        assert_eq!(room(5, "vg", 10, 5), Ok(()));
        assert_eq!(room(11, "vg", 10, 10).unwrap_err().kind, Kind::OutOfRange);
        assert_eq!(
            room(6, "vg", 10, 5).unwrap_err().kind,
            Kind::ResourceExhausted
        );
        assert_eq!(
            room(6, "volume group vg", 10, 5).unwrap_err().message,
            "volume group vg has 5 bytes free, 6 needed"
        );
        assert_eq!(
            Error::unknown_parameter("lvm", "k", &["deviceClass"]).message,
            "backend lvm takes no parameter \"k\" (it takes deviceClass)"
        );
        assert_eq!(
            Error::in_use("volume v", "logged in from n1", "unstage it first").message,
            "volume v is in use (logged in from n1); unstage it first"
        );
    }

    #[test]
    fn io_errors_keep_context_and_classify() {
        let e = Error::io(
            "open /x",
            std::io::Error::from(std::io::ErrorKind::NotFound),
        );
        assert_eq!(e.kind, Kind::NotFound);
        assert!(e.message.starts_with("open /x: "));
        let e = e.context("stage");
        assert!(e.message.starts_with("stage: open /x"));
    }
}
