//! The iscsi backend's own health reasons: tgtd's target gone, and
//! open-iscsi's sessions and disks as a node sees them (the exports say
//! the rest).

crate::reasons! {
    /// The health reasons only this backend gives (the shared ones are
    /// [`crate::plugin::health::Reason`]'s).
    pub mod reasons {
        /// tgtd no longer serves the volume's target.
        TargetMissing,
        /// No iSCSI session to the volume's target.
        SessionMissing,
        /// The iSCSI session to the volume's target is not logged in.
        SessionDown,
        /// One path of a multipath volume is down; the others carry it.
        PathDown,
        /// The multipath map of the volume is gone.
        MultipathMapGone,
        /// The staged device is no longer a disk of the volume's session.
        LunMissing,
    }
}
