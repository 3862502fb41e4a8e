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
