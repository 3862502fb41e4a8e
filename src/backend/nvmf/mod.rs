//! The `nvmf` backend, NVMe over TCP, being built as the export layer's
//! second protocol ([`super::export`]): its target server is the kernel's
//! nvmet through configfs ([`nvmet`]), its initiator the kernel's NVMe-oF
//! host through `/dev/nvme-fabrics` and sysfs ([`fabrics`]). Not a kind
//! yet: its descriptor, settings and deployment come next.

pub mod fabrics;
pub mod nvmet;
#[cfg(test)]
mod tests;

crate::reasons! {
    /// The health reasons only this backend gives (the shared ones are
    /// [`crate::plugin::health::Reason`]'s).
    pub mod reasons {
        /// nvmet no longer serves the volume's subsystem.
        SubsystemMissing,
        /// No NVMe controller of the volume's subsystem on the node.
        ControllerMissing,
        /// No controller of the volume's subsystem is live.
        ControllerDown,
        /// One controller (path) of the volume is down; others carry it.
        NvmePathDown,
        /// The staged device is no longer the subsystem's namespace.
        NamespaceMissing,
    }
}
