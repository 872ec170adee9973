//! The gate's lease and its off switch. The gate is a reservation of every license of its name
//! (`multiplex-gate`), renewed a third of `lease_s` before it lapses; switched off
//! (`multiplexd gate off`), a reservation `multiplex-off` holds one of those licenses instead,
//! so that no gate of all of them can be made until it is switched on again, and every
//! claimer, seeing it, neither gates nor claims.

use crate::slurm::{Gate, Reservation, Slurm, SlurmError};

pub use crate::slurm::{GATE_RESERVATION as RESERVATION, OFF_RESERVATION};
pub use multiplex_protocol::spec::GATE_LICENSE as LICENSE;
/// How often a claimer asks whether the gate was switched off or on (one `scontrol show
/// reservation`), and always before it renews the gate: switched on again, the gate is made
/// within this.
pub const OFF_EVERY_S: f64 = 5.0;

/// The gate of `count` licenses, as the claimer and `multiplexd gate` name it.
pub fn gate(count: u32) -> Gate {
    Gate {
        reservation: RESERVATION.into(),
        license: LICENSE.into(),
        count,
        off: OFF_RESERVATION.into(),
    }
}

/// A claimer's hold on the gate.
pub(super) struct Keeper {
    pub(super) gate: Gate,
    /// The lease was last renewed then.
    renewed: Option<f64>,
    /// When the off switch was last asked, and what it said.
    off: Option<(f64, bool)>,
}

impl Keeper {
    pub(super) fn new(count: u32) -> Keeper {
        Keeper {
            gate: gate(count),
            renewed: None,
            off: None,
        }
    }

    fn renewal_due(&self, lease_s: u64, now: f64) -> bool {
        self.renewed.is_none_or(|at| now - at >= (lease_s / 3) as f64)
    }

    /// Whether the gate is switched off, asked every [`OFF_EVERY_S`] and before a renewal
    /// (read from `listed`, the reservations this look already read, where there are), and
    /// with it whether that changed since the last answer (`Some(off)`).
    pub(super) fn switched_off(
        &mut self,
        slurm: &dyn Slurm,
        lease_s: u64,
        now: f64,
        listed: Option<&[Reservation]>,
    ) -> Result<(bool, Option<bool>), SlurmError> {
        let was = self.off.map(|(_, off)| off);
        let stale = self.off.is_none_or(|(at, _)| now - at >= OFF_EVERY_S);
        let due = listed.is_some() || stale || (was == Some(false) && self.renewal_due(lease_s, now));
        if due {
            let read;
            let all = match listed {
                Some(all) => all,
                None => {
                    read = slurm.reservations()?;
                    &read
                }
            };
            let off = all.iter().any(|r| r.name == self.gate.off);
            self.off = Some((now, off));
            if off {
                // Switched on again, the gate is made at once.
                self.renewed = None;
            }
        }
        let off = self.off.is_some_and(|(_, off)| off);
        let changed = match was {
            Some(was) => (was != off).then_some(off),
            None => off.then_some(true),
        };
        Ok((off, changed))
    }

    /// Renews the gate's lease once a third of it has passed (making it where it is missing).
    pub(super) fn hold(&mut self, slurm: &dyn Slurm, lease_s: u64, now: f64) -> Result<(), SlurmError> {
        if self.renewal_due(lease_s, now) {
            slurm.hold_gate(&self.gate, lease_s)?;
            self.renewed = Some(now);
        }
        Ok(())
    }
}
