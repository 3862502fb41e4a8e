//! The lvm commands the backend runs, each through the exec seam with a
//! timeout, reading JSON reports.

use super::report::{
    parse_lv_rows, parse_lvs, parse_vgs, Lv, Vg, LV_FIELDS, VG_FIELDS, VG_FIGURES,
};
use super::{DeviceClass, LvmBackend, COPY_TIMEOUT, LVM_TIMEOUT, TAG};
use crate::error::{Error, Result};
use crate::exec::{Command, ExecError};
use std::path::PathBuf;

/// A class's group as a create or an expansion sees it ([`LvmBackend::sight`]).
pub(super) struct Sight {
    /// An LV of ours with the new volume's name.
    pub existing: Option<Lv>,
    /// The class's thin pool, where it has one and lvs found it.
    pub pool: Option<Lv>,
    /// The group, from the rows (none came back for a thick class's new
    /// LV: [`LvmBackend::vg`] reads it then).
    pub vg: Option<Vg>,
}

impl LvmBackend {
    pub(super) fn lvm(&self, tool: &str) -> Command {
        let mut cmd = Command::new(tool)
            .timeout(LVM_TIMEOUT)
            .env("LVM_SUPPRESS_FD_WARNINGS", "1");
        let config = self.settings.config_text(&self.attached);
        if !config.is_empty() {
            cmd = cmd.arg("--config").arg(config);
        }
        cmd
    }

    /// An lvm reporting command (`lvs`, `vgs`) answering `fields` as JSON,
    /// sizes in `units` without suffix.
    fn report(&self, tool: &str, units: &str, fields: &str) -> Command {
        self.lvm(tool).args([
            "--reportformat",
            "json",
            "--units",
            units,
            "--nosuffix",
            "-o",
            fields,
        ])
    }

    pub(super) async fn lvs(&self, target: &str) -> Result<Vec<Lv>> {
        let out = self
            .runner
            .run(self.report("lvs", "b", LV_FIELDS).arg(target))
            .await;
        match out {
            Ok(o) => parse_lvs(&o.stdout),
            // lvs exits 5 when the named LV does not exist.
            Err(e) if e.exit_code() == Some(5) && target.contains('/') => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }

    /// What making or growing volume `lv_name` in `class` needs to know,
    /// in one read (one lvs of the LV and the class's thin pool, each row
    /// with the group's figures): the LV if one of ours has that name, the
    /// pool, the group's figures where a row came back.
    pub(super) async fn sight(&self, class: &DeviceClass, lv_name: &str) -> Result<Sight> {
        let mut names = vec![lv_name];
        if let Some(pool) = &class.thin_pool {
            names.push(pool);
        }
        let (rows, vg) = self.look(class, &names).await?;
        let find = |name: &str| rows.iter().find(|l| l.lv_name == name).cloned();
        let existing = find(lv_name).filter(|l| l.has_tag(TAG));
        let pool = class.thin_pool.as_deref().and_then(find);
        Ok(Sight { existing, pool, vg })
    }

    /// One lvs of the LVs `names` in `class`'s group, each row with the
    /// group's figures: the rows of those that exist (of any owner), and
    /// the group where a row came back.
    pub(super) async fn look(
        &self,
        class: &DeviceClass,
        names: &[&str],
    ) -> Result<(Vec<Lv>, Option<Vg>)> {
        let vg_name = &class.volume_group;
        let mut cmd = self.report("lvs", "b", &format!("{LV_FIELDS},{VG_FIGURES}"));
        for name in names {
            cmd = cmd.arg(format!("{vg_name}/{name}"));
        }
        // lvs exits 5 when a named LV does not exist, and reports the
        // others.
        let report = match self.runner.run(cmd).await {
            Ok(o) => o.stdout,
            Err(ExecError::Failed { output, .. }) if output.code == Some(5) => output.stdout,
            Err(e) => return Err(e.into()),
        };
        let rows = if report.trim().is_empty() {
            Vec::new()
        } else {
            parse_lv_rows(&report)?
        };
        let vg = rows.iter().find_map(|(_, vg)| vg.clone());
        let lvs = rows
            .into_iter()
            .map(|(lv, _)| lv)
            .filter(|l| l.vg_name == *vg_name)
            .collect();
        Ok((lvs, vg))
    }

    pub(super) async fn lv(&self, vg: &str, lv: &str) -> Result<Option<Lv>> {
        Ok(self
            .lvs(&format!("{vg}/{lv}"))
            .await?
            .into_iter()
            .find(|l| l.lv_name == lv && l.has_tag(TAG)))
    }

    /// An LV's read-ahead setting as lvs reports it in sectors (`auto`,
    /// or a count; 0 for none).
    pub(super) async fn read_ahead(&self, target: &str) -> Result<String> {
        let out = self
            .runner
            .run(self.report("lvs", "s", "lv_read_ahead").arg(target))
            .await?;
        let v: serde_json::Value = serde_json::from_str(&out.stdout)
            .map_err(|e| Error::internal(format!("lvs report: {e}")))?;
        v["report"][0]["lv"][0]["lv_read_ahead"]
            .as_str()
            .map(|s| s.trim().to_string())
            .ok_or_else(|| Error::internal(format!("lvs reported no read-ahead for {target}")))
    }

    pub(super) async fn vg(&self, class: &DeviceClass) -> Result<Vg> {
        let out = self
            .runner
            .run(self.report("vgs", "b", VG_FIELDS).arg(&class.volume_group))
            .await?;
        parse_vgs(&out.stdout)?
            .into_iter()
            .find(|v| v.vg_name == class.volume_group)
            .ok_or_else(|| {
                Error::precondition(format!("volume group {} not found", class.volume_group))
            })
    }

    /// Why an LV of `class` that lvs does not list may not be gone: its
    /// volume group cannot be read (lvs then lists nothing of it), as when
    /// its physical volumes are missing or failing. None when the group
    /// reads, and the LV is gone.
    pub(super) async fn unreadable_group(&self, class: &DeviceClass) -> Option<String> {
        self.vg(class).await.err().map(|e| {
            format!(
                "volume group {} cannot be read ({}): its physical volumes are missing or failing",
                class.volume_group, e.message
            )
        })
    }

    /// Thin pool: (size, free) in bytes.
    pub(super) async fn pool_space(&self, class: &DeviceClass, pool: &str) -> Result<(u64, u64)> {
        let p = self.pool(class, pool).await?;
        let used_pct: f64 = p.data_percent.trim().parse().unwrap_or(0.0);
        let size = p.size();
        Ok((
            size,
            ((size as f64) * (1.0 - used_pct / 100.0)).max(0.0) as u64,
        ))
    }

    pub(super) async fn pool(&self, class: &DeviceClass, pool: &str) -> Result<Lv> {
        let lvs = self.lvs(&format!("{}/{pool}", class.volume_group)).await?;
        lvs.into_iter().find(|l| l.lv_name == pool).ok_or_else(|| {
            Error::precondition(format!("thin pool {}/{pool} not found", class.volume_group))
        })
    }

    /// What a failed lvcreate or lvextend means, judged from lvm's own
    /// figures read after it, never from its wording: RESOURCE_EXHAUSTED
    /// when the volume group now has less free than `from_vg` bytes (the
    /// extents the call needed from it; 0 for thin volumes), or when the
    /// class's thin pool is full; otherwise the failure as it was.
    /// Runs an LVM command that takes space; a failure is judged as
    /// [`LvmBackend::judge_failure`] says.
    pub(super) async fn run_judged(
        &self,
        class: &DeviceClass,
        from_vg: u64,
        cmd: Command,
    ) -> Result<()> {
        match self.runner.run(cmd).await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.judge_failure(class, from_vg, e.into()).await),
        }
    }

    pub(super) async fn judge_failure(&self, class: &DeviceClass, from_vg: u64, e: Error) -> Error {
        if from_vg > 0 {
            if let Ok(vg) = self.vg(class).await {
                if vg.free() < from_vg {
                    return Error::no_room(
                        format_args!("volume group {}", class.volume_group),
                        vg.free(),
                        format_args!("{from_vg} ({})", e.message.trim()),
                    );
                }
            }
        } else if let Some(pool) = &class.thin_pool {
            if let Ok(p) = self.pool(class, pool).await {
                if p.pool_full() {
                    return Error::exhausted(format!(
                        "thin pool {}/{pool} is full: data {}%, metadata {}% ({})",
                        class.volume_group,
                        p.data_percent.trim(),
                        p.metadata_percent.trim(),
                        e.message.trim()
                    ));
                }
            }
        }
        e
    }

    /// Copies one LV's data into another (both active on this node).
    pub(super) async fn copy_lv(&self, vg: &str, from: &str, to: &str) -> Result<()> {
        self.activate(vg, from).await?;
        self.activate(vg, to).await?;
        let src = format!("/dev/{vg}/{from}");
        let dst = format!("/dev/{vg}/{to}");
        self.runner
            .run(
                Command::new("dd")
                    .args([
                        format!("if={src}"),
                        format!("of={dst}"),
                        "bs=4M".into(),
                        "conv=fsync,sparse".into(),
                    ])
                    .args(["status=none", "iflag=direct"])
                    .timeout(COPY_TIMEOUT),
            )
            .await?;
        Ok(())
    }

    pub(super) async fn activate(&self, vg: &str, lv: &str) -> Result<PathBuf> {
        // -K: thin snapshots skip activation by default.
        self.runner
            .run(
                self.lvm("lvchange")
                    .args(["-ay", "-K", "-y", &format!("{vg}/{lv}")]),
            )
            .await?;
        Ok(PathBuf::from(format!("/dev/{vg}/{lv}")))
    }

    pub(super) async fn deactivate(&self, vg: &str, lv: &str) -> Result<()> {
        self.runner
            .run(self.lvm("lvchange").args(["-an", &format!("{vg}/{lv}")]))
            .await?;
        Ok(())
    }
}
