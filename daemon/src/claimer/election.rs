//! Which of the daemons with `[claim] enabled` claims: the one that holds the claimers' lease,
//! a reservation `multiplex-claimer-NODE` of the one license `multiplex-claimer` slurm.conf has.
//! That license is Slurm's own lock: while one such reservation is in force, slurmctld makes
//! no other. The holder renews it every [`RENEW_S`] for [`TAKEOVER_S`]; the others stand by,
//! each asking every [`RENEW_S`] (one `scontrol show reservation`), and the first to find it
//! lapsed takes it: within [`TAKEOVER_S`] and [`RENEW_S`] of the holder's end (killed, its host
//! gone), long before the gate's own lease (`lease_s`) would let jobs through.
//!
//! Two never both claim. A holder claims only while its lease runs, less [`MARGIN_S`], by its
//! own clock from its last renewal; a standby takes it only once slurmctld says it lapsed. A
//! lapsed reservation holds nothing, but slurmctld brings it back if its end time is updated,
//! without asking for the license again: so a holder renews only within its lease, and one
//! that finds another lease in force beside its own after renewing gives its own up.

use crate::slurm::{Reservation, Slurm, SlurmError};

/// The license of the claimers' lease: slurm.conf has one (`Licenses=...,multiplex-claimer:1`).
pub const LEASE_LICENSE: &str = "multiplex-claimer";
/// The lease of the daemon on node NODE is the reservation `multiplex-claimer-NODE`.
pub const LEASE_PREFIX: &str = "multiplex-claimer-";
/// How long a renewal holds the lease.
pub const TAKEOVER_S: u64 = 15;
/// How often the holder renews it, and a standby asks whether it lapsed.
pub const RENEW_S: f64 = 5.0;
/// How long before its lease ends, by its own clock, a holder stops claiming: what a slow
/// call to slurmctld, or clocks apart, may take.
pub const MARGIN_S: f64 = 5.0;

/// One daemon's part in the election.
#[derive(Debug)]
pub struct Election {
    /// Its lease's reservation.
    name: String,
    /// Until when (its own clock) its lease runs, where it holds it.
    held_until: Option<f64>,
    /// When it last asked slurmctld.
    asked: Option<f64>,
    /// Every reservation, as its last ask read them, until taken ([`Election::take_listed`]).
    listed: Option<Vec<Reservation>>,
}

impl Election {
    /// The daemon of `node` standing for the lease.
    pub fn new(node: &str) -> Election {
        Election {
            name: format!("{LEASE_PREFIX}{node}"),
            held_until: None,
            asked: None,
            listed: None,
        }
    }

    /// The reservations its ask of this look read, if it asked: the off switch reads them
    /// there instead of asking slurmctld again.
    pub fn take_listed(&mut self) -> Option<Vec<Reservation>> {
        self.listed.take()
    }

    fn holds(&self, now: f64) -> bool {
        self.held_until.is_some_and(|until| now < until - MARGIN_S)
    }

    /// Whether this daemon claims now: it renews its lease, or takes it where none is in
    /// force, when [`RENEW_S`] has passed since it last asked.
    pub fn leads(&mut self, slurm: &dyn Slurm, now: f64) -> Result<bool, SlurmError> {
        if self.asked.is_some_and(|at| now - at < RENEW_S) {
            return Ok(self.holds(now));
        }
        if self.holds(now) {
            let renewed = slurm.renew_lease(&self.name, TAKEOVER_S)?;
            self.held_until = renewed.then_some(now + TAKEOVER_S as f64);
        } else {
            self.held_until = None;
        }
        let all = slurm.reservations()?;
        let leases: Vec<_> = all
            .iter()
            .filter(|r| r.name.starts_with(LEASE_PREFIX))
            .cloned()
            .collect();
        self.listed = Some(all);
        self.asked = Some(now);
        if self.held_until.is_some() {
            if leases.iter().any(|r| r.active && r.name != self.name) {
                slurm.delete_reservation(&self.name)?;
                self.held_until = None;
            }
            return Ok(self.holds(now));
        }
        if leases.iter().any(|r| r.active) {
            return Ok(false);
        }
        // Lapsed leases hold nothing; deleted, their holders cannot bring them back.
        for r in &leases {
            slurm.delete_reservation(&r.name)?;
        }
        if slurm.take_lease(&self.name, LEASE_LICENSE, TAKEOVER_S)? {
            self.held_until = Some(now + TAKEOVER_S as f64);
        }
        Ok(self.holds(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slurm::{Fake, FakeState};

    fn slurm() -> Fake {
        Fake::new(FakeState {
            lease_licenses: 1,
            ..FakeState::default()
        })
    }

    fn at(slurm: &Fake, t: u64) {
        slurm.state.lock().unwrap().now = t;
    }

    #[test]
    fn one_of_two_standing_at_once_leads_and_the_other_takes_over_once_its_lease_lapsed() {
        let slurm = slurm();
        let (mut a, mut b) = (Election::new("n1"), Election::new("n2"));
        assert!(a.leads(&slurm, 0.0).unwrap());
        assert!(!b.leads(&slurm, 0.0).unwrap());
        // a renews every RENEW_S; b, asking as often, stays by.
        for t in [5, 10, 15, 20] {
            at(&slurm, t);
            assert!(a.leads(&slurm, t as f64).unwrap(), "a at {t}");
            assert!(!b.leads(&slurm, t as f64).unwrap(), "b at {t}");
        }
        // a dies at 20: its lease runs to 35, b takes it at the first look after.
        for t in [25, 30] {
            at(&slurm, t);
            assert!(!b.leads(&slurm, t as f64).unwrap(), "b at {t}");
        }
        at(&slurm, 35);
        assert!(b.leads(&slurm, 35.0).unwrap());
        let s = slurm.state.lock().unwrap();
        assert_eq!(s.leases, vec![("multiplex-claimer-n2".to_string(), 50)]);
    }

    #[test]
    fn a_holder_whose_lease_went_takes_it_again_where_no_other_holds_it() {
        let slurm = slurm();
        let mut a = Election::new("n1");
        assert!(a.leads(&slurm, 0.0).unwrap());
        slurm.delete_reservation("multiplex-claimer-n1").unwrap();
        // Within RENEW_S it does not ask; then its renewal finds none, and it takes a new one.
        assert!(a.leads(&slurm, 4.0).unwrap());
        at(&slurm, 5);
        assert!(a.leads(&slurm, 5.0).unwrap());
        assert_eq!(
            slurm.state.lock().unwrap().leases,
            vec![("multiplex-claimer-n1".to_string(), 20)]
        );
    }

    #[test]
    fn a_holder_that_paused_past_its_lease_finds_it_taken_and_stands_by() {
        let slurm = slurm();
        let (mut a, mut b) = (Election::new("n1"), Election::new("n2"));
        assert!(a.leads(&slurm, 0.0).unwrap());
        // a stops for 40 s (its lease lapsed at 15); b takes it at 20.
        for t in [20, 25, 30, 35, 40] {
            at(&slurm, t);
            assert!(b.leads(&slurm, t as f64).unwrap(), "b at {t}");
        }
        assert!(!a.leads(&slurm, 40.0).unwrap());
        // Had its renewal come back (slurmctld revives a lapsed reservation), it would have
        // found b's beside it and given its own up: played through the fake by hand.
        slurm
            .state
            .lock()
            .unwrap()
            .leases
            .push(("multiplex-claimer-n1".into(), 55));
        a.held_until = Some(55.0);
        a.asked = None;
        at(&slurm, 41);
        assert!(!a.leads(&slurm, 41.0).unwrap());
        assert_eq!(slurm.state.lock().unwrap().leases.len(), 1);
    }

    #[test]
    fn without_the_lease_license_no_one_leads_through_an_election() {
        let slurm = Fake::new(FakeState::default());
        assert!(!Election::new("n1").leads(&slurm, 0.0).unwrap());
    }
}
