//! The `file` backend on the real kernel.

use super::*;

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_file_backend_ext4_grows_online() {
    require_guest();
    Harness::start()
        .await
        .check_online_growth("ext4", 64 * MIB, 256 * MIB, 150 * MIB)
        .await;
}
